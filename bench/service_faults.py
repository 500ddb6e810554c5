"""kill -9 at random moments of an SDK training loop against a live service: the API, the worker
(its supervisor process alone: what it started must die with it) and the Executor, each restarted
(the API and the worker by the harness, as systemd would; the Executor by Ray).

    .venv/bin/python bench/service_faults.py [--kills 12] [--seed 0]

Every step must be applied exactly once: the model's forward logprobs on the training batch at the
end must equal, bit for bit, those of the same number of steps run uninterrupted in this process.
MKL runs single-threaded here and in the service (bitwise equality across processes needs it on
some CPUs, docs/architecture.md "Decisions").
"""

from __future__ import annotations

import os

os.environ["MKL_NUM_THREADS"] = "1"  # before torch: this process computes the reference

import argparse  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import emit  # noqa: E402
from service_harness import KINDS, Service, reference_logprobs, train_under_faults  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    kills = [KINDS[i % len(KINDS)] for i in range(a.kills)]  # each kind equally often, in random order
    rng.shuffle(kills)
    svc = Service(Path(tempfile.mkdtemp(prefix="lockstep-faults-")), env={"MKL_NUM_THREADS": "1"}).start()
    try:
        run = train_under_faults(svc, svc.tenant("faults"), kills, seed=a.seed, gap_s=(0.0, 3.0))
    finally:
        svc.stop()
    want = reference_logprobs(run.data, run.steps)
    equal = all((x == y).all() for x, y in zip(run.logprobs, want))
    counts = Counter(kind for _, kind, _ in run.kills)
    emit("service_faults", [{"kills": len(run.kills), **{f"kill_{k}": counts[k] for k in KINDS}, "steps": run.steps,
                             "wall_s": round(run.wall_s, 1), "bitwise_equal_to_uninterrupted": equal}],
         {"kills": [{"t_s": t, "kind": k, "steps_done": s} for t, k, s in run.kills], "log": str(svc.log)})
    if not equal:
        raise SystemExit("the final weights differ from an uninterrupted run's")


if __name__ == "__main__":
    main()
