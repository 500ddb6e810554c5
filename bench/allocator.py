"""The closed-loop allocator against a grid of static splits, side by side on one machine.

    .venv/bin/python bench/allocator.py [--steps 150] [--rounds 2] [--window 10]

The same asynchronous GRPO stage (the built-in model, 8 prompts x 8 samples a step, max_staleness
1, a fixed number of steps, every core of the machine as the run's budget) under each static split
(runtime.allocator = false: trainer:generator threads 1:1, 2:1, 1:2, with 1 or 2 env workers) and
under the allocator (runtime.allocator = true, a decision every `--window` steps; it builds one
env worker per rollout batch in flight with the run, runtime/plan.py), and under the allocator
with rollout.replicas = "auto" (it may also run a second generator replica). Each run is its own `lockstep run` process; the configurations are run in
rounds, in the same order each round, so that drift of the machine touches every one alike.
Per configuration: steps/s and sampled tokens/s over the RL stage (the median over rounds); for
the allocator, its ratio to the best and to the worst static split and the plans it chose.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from statistics import median

sys.path.insert(0, "bench")
from common import emit  # noqa: E402

LOCKSTEP = [sys.executable, "-m", "lockstep.cli"]
STAGE = ("stages=[{kind = 'rl', steps = %d, prompts_per_step = 8, group_size = 8, max_staleness = 1, "
         "eval_every = 100000, max_seconds = 0, target_accuracy = 0.0, learning_rate = 2e-4}]")
STATIC = [(t, g, e) for e in (1, 2) for t, g in ((1, 1), (2, 1), (1, 2))]
"""(trainer threads, generator threads, env workers) of each static split."""


def one(run_dir: Path, steps: int, overrides: list[str]) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [*LOCKSTEP, "run", "--run-dir", str(run_dir), STAGE % steps, "env.num_heldout=8", "env.pass_k=0",
           "runtime.checkpoint_every=0", *overrides]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    summary = json.loads((run_dir / "summary.json").read_text())
    rl = next(r for r in summary["stages"] if r["stage"] == "rl")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    decisions = [r for r in records if "alloc/reason" in r]
    plans = Counter(f"{r['alloc/trainer_threads']}:{r['alloc/generator_threads']}/{r['alloc/env_workers']}"
                    f"/{r['alloc/generator_replicas']}" for r in decisions)
    return {"steps_per_s": rl["steps"] / rl["seconds"],
            "sampled_tokens_per_s": summary["counters"]["tokens/sampled"] / rl["seconds"],
            "plans": dict(plans), "replans": sum(r["alloc/reason"] == 5 for r in decisions)}


def configs(window: int) -> dict[str, list[str]]:
    out = {f"static {t}:{g}, {e} env": ["runtime.allocator=false", f"runtime.trainer_threads={t}",
                                         f"runtime.generator_threads={g}", f"runtime.env_workers={e}"]
           for t, g, e in STATIC}
    out["allocator"] = ["runtime.allocator=true", "runtime.env_workers=1", f"runtime.allocator_window={window}"]
    out["allocator, auto replicas"] = [*out["allocator"], "rollout.replicas='auto'"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--work", default="bench/.work/allocator")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for name, overrides in configs(args.window).items():
            res = one(Path(args.work) / f"{name.replace(' ', '_').replace(':', '-').replace(',', '')}-{r}", args.steps,
                      overrides)
            runs.setdefault(name, []).append(res)
            print(f"round {r}: {name}: {res['steps_per_s']:.3f} steps/s {res['plans'] or ''}", file=sys.stderr,
                  flush=True)
    rows = [{"config": name, "steps_per_s": median(x["steps_per_s"] for x in rs),
             "sampled_tokens_per_s": median(x["sampled_tokens_per_s"] for x in rs),
             "per_round_steps_per_s": " / ".join(f"{x['steps_per_s']:.2f}" for x in rs)} for name, rs in runs.items()]
    static = [r for r in rows if not r["config"].startswith("allocator")]
    best, worst = max(static, key=lambda r: r["steps_per_s"]), min(static, key=lambda r: r["steps_per_s"])
    summary = {"steps": args.steps, "rounds": args.rounds, "window": args.window,
               "best_static": best["config"], "worst_static": worst["config"]}
    for alloc in (r for r in rows if r["config"].startswith("allocator")):
        name = alloc["config"]
        summary[name] = {"vs_best": alloc["steps_per_s"] / best["steps_per_s"],
                         "vs_worst": alloc["steps_per_s"] / worst["steps_per_s"],
                         "plans (threads t:g / env workers / replicas: windows)": [x["plans"] for x in runs[name]],
                         "replans": [x["replans"] for x in runs[name]]}
    emit("allocator", rows, summary)


if __name__ == "__main__":
    main()
