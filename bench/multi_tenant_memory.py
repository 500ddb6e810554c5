"""Worker memory with K LoRA training clients of one base model (issue 28, item 5, memory).

Each K runs in a fresh process holding an EngineHost, as a worker's Executor does (the Ray actor
around it adds the same constant for every K): K LoRA rank-16 clients (attention and MLP, and with
--unembed lm_head too, the SDK's default) of a 0.5B-shaped random Qwen2 (Qwen2.5-0.5B's config, built here, no
download), each after one forward_backward (4 x 32 tokens) and one optim_step, so that its
gradients and AdamW moments exist. Reports the process's RSS, and what the host's model cache
counts, at each K. Goal: RSS at K = 16 <= 2.5x RSS at K = 1.

    python bench/multi_tenant_memory.py [--clients 1 4 16] [--model qwen2-0.5b|builtin] [--rank 16] [--unembed]
                                        [--private]

--unembed adds lm_head to the targets (on the shared base, as the other targets). --private holds
each client as a private peft copy of the model instead (the host's shares_base forced false), the
way every LoRA client was held before issue 28, and a LoRA with lm_head until it became a shared
target.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
                 rope_theta=1000000.0, rms_norm_eps=1e-6)
"""Qwen2-0.5B's architecture (as bench/gpu_check.py), randomly initialised: 494M parameters."""


def model_path(name: str) -> str:
    from lockstep.engine.tiny import ensure_tiny_model, save_model_dir

    if name == "builtin":
        return str(ensure_tiny_model())
    path = Path("bench/.models/qwen2-0.5b-random")
    if not (path / "config.json").exists():
        from transformers import Qwen2Config

        save_model_dir(path, Qwen2Config(**QWEN2_05B), seed=0)
    return str(path)


def one_run(base: str, clients: int, rank: int, unembed: bool, private: bool) -> dict:
    """In this process: K clients trained one step each; RSS and the host's counts."""
    import numpy as np
    import psutil

    from lockstep.service import host as host_mod
    from lockstep.service import wire
    from lockstep.service.host import EngineHost

    if private:
        host_mod.shares_base = lambda spec: False

    work = Path(tempfile.mkdtemp(prefix="lockstep-mtm-"))
    host = EngineHost(str(work / "storage"), str(work / "cache"), 2, max_models=clients)
    rng = np.random.default_rng(0)
    for i in range(clients):
        mid = f"m{i}"
        host.create_model(mid, base, {"rank": rank, "seed": i, "train_unembed": unembed})
        data = tuple(wire.WireDatum(tuple(int(t) for t in rng.integers(4, 200, 32)),
                                    {"target_tokens": rng.integers(4, 200, 32).astype(np.int64),
                                     "weights": np.ones(32, np.float32)}) for _ in range(4))
        host.forward_backward(mid, wire.encode_forward_backward(wire.FwdBwd(mid, 1, data, "cross_entropy", {}, False)),
                              False)
        host.optim_step(mid, {"learning_rate": 1e-4})
    assert len(host.trainers) == clients and len(host.bases) == (0 if private else 1) and not host.spilled
    counted = {kind: sum(e.nbytes for e in host.models.entries.values() if e.kind == kind) for kind in ("base", "model")}
    return {"clients": clients, "rss_mib": psutil.Process().memory_info().rss / 2**20,
            "base_counted_mib": counted["base"] / 2**20, "clients_counted_mib": counted["model"] / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--model", choices=("qwen2-0.5b", "builtin"), default="qwen2-0.5b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--unembed", action="store_true", help="LoRA on lm_head too (the SDK's default)")
    ap.add_argument("--private", action="store_true",
                    help="each client a private peft copy of the model (the code before issue 28)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: run one K in this process
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(one_run(model_path(a.model), a.one, a.rank, a.unembed, a.private)))
        return
    model_path(a.model)  # built once, before any measured process
    rows = []
    for k in a.clients:  # a fresh process per K: RSS never carries one run's high-water mark into the next
        flags = ["--unembed"] * a.unembed + ["--private"] * a.private
        out = subprocess.run([sys.executable, __file__, "--one", str(k), "--model", a.model, "--rank", str(a.rank)] + flags,
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # each K as it ends: a long run keeps what it measured
    one = rows[0]["rss_mib"]
    for r in rows:
        r["rss_vs_first"] = r["rss_mib"] / one
    from common import emit

    emit("multi_tenant_memory" + "_unembed" * a.unembed + "_private" * a.private, rows,
         {"model": a.model, "rank": a.rank, "unembed": a.unembed, "private": a.private})


if __name__ == "__main__":
    main()
