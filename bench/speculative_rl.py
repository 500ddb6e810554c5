"""End-to-end RL on the long-completion task with speculative decoding off and on: time to a held-out
accuracy, side by side.

    .venv/bin/python bench/speculative_rl.py [--repeats 1 --target 0.5 --max-seconds 600 --sft-steps 1500]

The starting model is bench/speculative.py's (the built-in model after a supervised warm-up on
`long_addition`, worked answers of 72 tokens); the RL stage is bench/configs/rl_only.toml's GRPO
(16 prompts x 8 samples a step, staleness 2) on `long_addition`, changing only
`rollout.speculative`: off; the model drafter with `auto` (learning online from the run's own
rollouts); the suffix drafter with `auto`. Runs alternate (off, model, suffix, off, ...). Besides
the time to target, each run's median step time and the generator's acceptance are reported.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import median

from common import emit
from rl_common import lockstep_rl
from speculative import long_model

SIDES = {
    "off": [],
    "model_auto": ["rollout.speculative.drafter=model", "rollout.speculative.auto=true"],
    "suffix_auto": ["rollout.speculative.drafter=suffix", "rollout.speculative.auto=true"],
}


def acceptance(run_dir: Path) -> dict:
    rl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if "speculative/drafted" in r]
    drafted = sum(r["speculative/drafted"] for r in rl)
    out = {"acceptance": sum(r["speculative/accepted"] for r in rl) / drafted if drafted else 0.0,
           "auto_off_steps": sum(r["speculative/auto_off_steps"] for r in rl)}
    if rl and "speculative/draft_lag" in rl[-1]:
        out.update(draft_version=rl[-1]["speculative/draft_version"], draft_lag_last=rl[-1]["speculative/draft_lag"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--max-seconds", type=float, default=600)
    ap.add_argument("--sft-steps", type=int, default=1500)
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--work", default="bench/.work")
    a = ap.parse_args()
    work = Path(a.work).resolve()
    model = long_model(work, a.sft_steps)
    rows = []
    for rep in range(a.repeats):
        for side in a.sides.split(","):
            run_dir = work / f"spec-rl-{side}-{rep}"
            r = lockstep_rl(model, run_dir, a.target, a.max_seconds, ["env.name=long_addition", *SIDES[side]])
            rows.append({"side": side, "repeat": rep, **r, **(acceptance(run_dir) if side != "off" else {})})
            print(rows[-1], flush=True)
    sides = a.sides.split(",")
    med = {s: median([r["seconds_to_target"] or float("inf") for r in rows if r["side"] == s]) for s in sides}
    step = {s: median([r["step_s_median"] for r in rows if r["side"] == s]) for s in sides}
    reached = {s: v for s, v in med.items() if v != float("inf")}  # (JSON has no infinity)
    emit("speculative_rl", rows, {"target": a.target, "model": str(model), "median_seconds_to_target": reached,
                                  "speedup_vs_off": {s: med["off"] / v for s, v in reached.items() if s != "off" and "off" in reached},
                                  "step_time_ratio_vs_off": {s: step["off"] / step[s] for s in sides if s != "off" and "off" in step}})


if __name__ == "__main__":
    main()
