"""Asynchronous (staleness 1 and 2) against synchronous GRPO: time to 80% held-out accuracy.

    .venv/bin/python bench/async_vs_sync.py --repeats 2 [--target 0.8 --max-seconds 900]

The same starting model (bench/rl_common.py) and RL stage (bench/configs/rl_only.toml), changing
only rl.max_staleness; runs are interleaved (0, 1, 2, 0, 1, 2, ...) so drift hits all alike.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from statistics import median

from common import emit
from rl_common import lockstep_rl, warm_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--max-seconds", type=float, default=900)
    ap.add_argument("--work", default="bench/.work")
    a = ap.parse_args()
    work = Path(a.work).resolve()
    model = warm_model(work)
    rows = []
    for rep in range(a.repeats):
        for staleness in (0, 1, 2):
            r = lockstep_rl(model, work / f"stale{staleness}-{rep}", a.target, a.max_seconds,
                            [f"rl.max_staleness={staleness}"])
            rows.append({"max_staleness": staleness, "repeat": rep, **r})
            print(rows[-1], flush=True)
    med = {s: median([r["seconds_to_target"] or float("inf") for r in rows if r["max_staleness"] == s]) for s in (0, 1, 2)}
    emit("async_vs_sync", rows, {"median_seconds_to_target": med,
                                 "speedup_vs_sync": {s: med[0] / med[s] for s in (1, 2)}})


if __name__ == "__main__":
    main()
