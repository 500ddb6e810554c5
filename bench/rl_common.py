"""Shared pieces of the RL benchmarks: the warmed-up starting model and lockstep's RL runs.

Every RL benchmark starts from the same model: the final_model of `lockstep run
bench/configs/sft_warmup.toml` (the embedded default's supervised warm-up, ~40% held-out greedy
accuracy). Time to target is measured the same way on every side: wall seconds from the start of
training to the first held-out evaluation at or above the target, minus the time spent in
evaluations up to then (both sides evaluate the same 200 held-out problems every 10 steps).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKSTEP = [sys.executable, "-m", "lockstep.cli"]


def warm_model(work: Path) -> Path:
    """The shared starting point, built once per work directory."""
    model = work / "sft_model"
    if not (model / "config.json").exists():
        run_dir = work / "sft_run"
        shutil.rmtree(run_dir, ignore_errors=True)
        subprocess.run([*LOCKSTEP, "run", str(ROOT / "bench/configs/sft_warmup.toml"), "--run-dir", str(run_dir)],
                       check=True, stdout=subprocess.DEVNULL)
        shutil.copytree(run_dir / "final_model", model)
    return model


def time_to_target(evals: list[dict], target: float) -> tuple[float | None, int | None, float]:
    """(seconds net of evaluation, step, accuracy) at the first eval >= target; None if never."""
    start = evals[0]
    for e in evals:
        if e["accuracy"] >= target:
            net = (e["time"] - start["time"]) - (e["eval_seconds_so_far"] - start["eval_seconds_so_far"])
            return round(net, 1), e["step"] - start["step"], e["accuracy"]
    return None, None, evals[-1]["accuracy"]


def lockstep_rl(model: Path, run_dir: Path, target: float, max_seconds: float, overrides=()) -> dict:
    """GRPO from `model` with bench/configs/rl_only.toml until `target` or `max_seconds`."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [*LOCKSTEP, "run", str(ROOT / "bench/configs/rl_only.toml"), "--run-dir", str(run_dir),
           f"model.path='{model}'", f"rl.target_accuracy={target}", f"rl.max_seconds={max_seconds}", "env.pass_k=0",
           *overrides]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    summary = json.loads((run_dir / "summary.json").read_text())
    secs, steps, acc = time_to_target(summary["evals"], target)
    rl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = sorted(r["time/step_s"] for r in rl if "time/step_s" in r)
    return {"seconds_to_target": secs, "steps_to_target": steps, "accuracy": acc,
            "start_accuracy": summary["evals"][0]["accuracy"], "step_s_median": step_s[len(step_s) // 2]}
