"""32 SDK clients against a live `lockstep serve` for 10 minutes: errors and memory.

    .venv/bin/python bench/service_load.py [--clients 32] [--seconds 600] [--warmup 120] [--max-models 16]

Each client has its own LoRA model and loops forward_backward + optim_step (4 datums x 16 tokens),
with a new sampler and a 4-sample request every 4th step. Memory is the resident set of the API,
the worker and its Executor together, every 5 s; its growth is the median of the last three samples
over the median of the first three after the warm-up. Passing: 0 errors, growth under 10%.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import emit  # noqa: E402
from service_harness import Service, load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--warmup", type=float, default=120)
    ap.add_argument("--max-models", type=int, default=16, help="the worker's trainers in memory (its default: 16)")
    a = ap.parse_args()
    svc = Service(Path(tempfile.mkdtemp(prefix="lockstep-load-")), worker_args=["--max-models", str(a.max_models)]).start()
    try:
        keys = [svc.tenant(f"load{i}", max_models=a.clients) for i in range(2)]
        run = load(svc, keys, clients=a.clients, seconds=a.seconds, warmup_s=a.warmup)
    finally:
        svc.stop()
    mib = [b / 2**20 for _, b in run.rss]
    after = [b / 2**20 for t, b in run.rss if t >= a.warmup]
    emit("service_load", [{"clients": run.clients, "max_models": a.max_models, "seconds": round(run.seconds),
                           "errors": len(run.errors),
                           "train_steps": run.steps, "steps_per_s": round(run.steps / run.seconds, 2),
                           "sample_calls": run.samples, "rss_start_mib": round(mib[0]),
                           "rss_after_warmup_mib": round(after[0]), "rss_end_mib": round(mib[-1]),
                           "rss_growth_after_warmup": round(run.growth(), 4)}],
         {"first_errors": run.errors[:5], "rss_mib": [(t, round(b / 2**20)) for t, b in run.rss]})
    if run.errors or run.growth() >= 0.10:
        raise SystemExit("errors, or memory grew by 10% or more after the warm-up")


if __name__ == "__main__":
    main()
