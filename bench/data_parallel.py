"""Trainer step time: one process against two data-parallel ranks (gloo), side by side.

    .venv/bin/python bench/data_parallel.py [--sizes builtin,5M] [--steps 8] [--repeats 3]

The step: 32 datums of 64 random tokens (cross-entropy), cut into 4 micro-batches, then one AdamW
step. Sides, alternating each repeat: one process with 1 torch thread, one process with 2 threads
(this machine's two cores), and two ranks of 1 thread each (engine/data_parallel.py: the same bits
as the one-process runs, asserted). Each side runs in fresh processes; the first 2 steps are
warm-up; the median step of the rest, then the median over repeats. The ranks also report the
time spent in the chained gradient sum (sends, receives, the broadcast and the adds).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "bench")
from common import emit, median, model_dir  # noqa: E402

MICRO, DATUMS, TOKENS = 4, 32, 64


def batch(step: int):
    import numpy as np

    from lockstep.engine.types import Datum

    rng = np.random.default_rng(7000 + step)
    data = [Datum.from_tokens(rng.integers(4, 260, TOKENS).tolist()) for _ in range(DATUMS)]
    return [data[i * DATUMS // MICRO:(i + 1) * DATUMS // MICRO] for i in range(MICRO)]


def worker(a) -> None:
    """One rank (or the one process): time each step, write the step times and the final weights' hash."""
    import hashlib

    import torch

    from lockstep.engine.data_parallel import DataParallel, init_group
    from lockstep.engine.trainer import Trainer
    from lockstep.engine.types import AdamParams

    torch.set_num_threads(a.threads)
    if a.world > 1:
        init_group(a.rank, a.world, "127.0.0.1", a.port)
    trainer = Trainer.from_pretrained(a.model)
    dp = DataParallel(trainer, rank=a.rank, world=a.world)
    chain_s = [0.0]
    inner = dp._chain

    def timed_chain(*args):
        t = time.perf_counter()
        out = inner(*args)
        chain_s[0] += time.perf_counter() - t
        return out

    dp._chain = timed_chain
    steps, chains = [], []
    for step in range(a.steps):
        chain_s[0] = 0.0
        t = time.perf_counter()
        dp.forward_backward(batch(step), "cross_entropy")
        dp.optim_step(AdamParams(learning_rate=1e-3))
        steps.append(time.perf_counter() - t)
        chains.append(chain_s[0])
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in trainer.params.values())).hexdigest()
    Path(a.out).write_text(json.dumps({"steps": steps, "chain": chains, "weights": digest}))


def side(model: str, world: int, threads: int, steps: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "OMP_"))}
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"{r}.json" for r in range(world)]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--model", model, "--rank", str(r),
                                   "--world", str(world), "--port", str(port), "--threads", str(threads),
                                   "--steps", str(steps), "--out", str(outs[r])], env=env) for r in range(world)]
        for p in procs:
            assert p.wait(timeout=1800) == 0
        runs = [json.loads(o.read_text()) for o in outs]
    assert len({r["weights"] for r in runs}) == 1  # every rank ends with the same weights
    step = median([max(r["steps"][i] for r in runs) for i in range(2, steps)])
    chain = median([max(r["chain"][i] for r in runs) for i in range(2, steps)])
    return {"step_s": step, "chain_s": chain, "weights": runs[0]["weights"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--sizes", default="builtin,5M")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    sides = (("1 process, 1 thread", 1, 1), ("1 process, 2 threads", 1, 2), ("2 ranks x 1 thread", 2, 1))
    rows = []
    for size in a.sizes.split(","):
        model = model_dir(size)
        got = {name: [] for name, _, _ in sides}
        for _ in range(a.repeats):
            for name, world, threads in sides:
                got[name].append(side(model, world, threads, a.steps))
        assert len({r["weights"] for runs in got.values() for r in runs}) == 1, "a side trained different bits"
        base = median([r["step_s"] for r in got["1 process, 1 thread"]])
        for name, world, threads in sides:
            step = median([r["step_s"] for r in got[name]])
            rows.append({"model": size, "side": name, "step_ms": step * 1e3,
                         "chain_ms": median([r["chain_s"] for r in got[name]]) * 1e3, "speedup_vs_1x1": base / step})
    emit("data_parallel", rows, {"micro_batches": MICRO, "datums": DATUMS, "tokens": TOKENS})


if __name__ == "__main__":
    main()
