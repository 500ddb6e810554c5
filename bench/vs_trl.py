"""lockstep against TRL's GRPOTrainer: time to 80% held-out greedy accuracy, side by side.

    bash bench/setup_trl.sh                                   # once: TRL in its own venv
    .venv/bin/python bench/vs_trl.py --repeats 2 [--target 0.8 --max-seconds 900]

Same starting model (bench/rl_common.py), task and held-out set, 16 prompts x 8 samples per step,
learning rate 2e-4, AdamW (0.9, 0.99), grad clip 1.0, 2 CPU threads in all. lockstep runs its
default RL stage (importance_sampling on exact sampler logprobs, GRPO advantages, dynamic
sampling, staleness 2, measured thread plan); TRL runs its defaults for everything else (see
bench/trl_grpo.py). Runs alternate lockstep, TRL, lockstep, TRL, ... so drift in the machine hits
both alike.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from statistics import median

from common import emit
from rl_common import ROOT, lockstep_rl, warm_model


def trl_rl(model: Path, out: Path, target: float, max_seconds: float) -> dict:
    subprocess.run([str(ROOT / "bench/.venv-trl/bin/python"), str(ROOT / "bench/trl_grpo.py"), "--model", str(model),
                    "--out", str(out), "--target", str(target), "--max-seconds", str(max_seconds),
                    "--eval-every", "10", "--threads", "2"], check=True, stdout=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    acc = max(e["accuracy"] for e in r["evals"])
    return {"seconds_to_target": r["time_to_target"], "steps_to_target": r["steps_to_target"], "accuracy": acc,
            "start_accuracy": r["evals"][0]["accuracy"], "step_s_median": r["step_seconds_median"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--max-seconds", type=float, default=900)
    ap.add_argument("--work", default="bench/.work")
    a = ap.parse_args()
    subprocess.run(["bash", str(ROOT / "bench/setup_trl.sh")], check=True)
    work = Path(a.work).resolve()
    model = warm_model(work)
    rows = []
    for rep in range(a.repeats):
        for name in ("lockstep", "trl"):
            if name == "lockstep":
                r = lockstep_rl(model, work / f"lockstep-{rep}", a.target, a.max_seconds)
            else:
                r = trl_rl(model, work / f"trl-{rep}.json", a.target, a.max_seconds)
            rows.append({"system": name, "repeat": rep, **r})
            print(rows[-1], flush=True)
    med = {n: median([r["seconds_to_target"] or float("inf") for r in rows if r["system"] == n]) for n in ("lockstep", "trl")}
    emit("vs_trl", rows, {"median_seconds_to_target": med, "speedup": med["trl"] / med["lockstep"]})


if __name__ == "__main__":
    main()
