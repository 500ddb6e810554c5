"""Weight sync over two generator replicas: rolling update against a fleet-wide pause.

    .venv/bin/python bench/rolling_update.py [--steps 30] [--repeats 2] [--prompts 16] [--group 8]

The same asynchronous GRPO stage (max_staleness 1, two generator replicas, two env workers, the
built-in model, the long_addition env (72-token answers, so that sampling is busy when weights
arrive), 16 prompts x 8 samples a step) run with rollout.weight_sync = "rolling" and
"pause", alternating, each as its own `lockstep run` process. --prompts and --group shrink the
trainer's batch while each batch still decodes 72 tokens: with few sequences a step, generation is
the slower stage and new weights arrive while replicas decode (a generation-bound run). Per run: sampled tokens per second
over the RL stage; the longest stall of one replica's decoding at a swap (its re-prefill, plus the
wait at the barrier in a pause); the longest fleet-wide pause (every replica held: "pause" only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, "bench")
from common import emit  # noqa: E402

LOCKSTEP = [sys.executable, "-m", "lockstep.cli"]
STAGE = ("stages=[{kind = 'rl', steps = %d, prompts_per_step = %d, group_size = %d, max_staleness = 1, "
         "eval_every = 100000, max_seconds = 0, target_accuracy = 0.0, learning_rate = 2e-4}]")


def one(run_dir: Path, steps: int, sync: str, prompts: int, group: int) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [*LOCKSTEP, "run", "--run-dir", str(run_dir), STAGE % (steps, prompts, group), "rollout.replicas=2",
           f"rollout.weight_sync='{sync}'", "runtime.env_workers=2", "env.name='long_addition'", "env.num_heldout=8",
           "runtime.allocator=false", "env.pass_k=0",
           "runtime.checkpoint_every=0"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    summary = json.loads((run_dir / "summary.json").read_text())
    rl = next(r for r in summary["stages"] if r["stage"] == "rl")
    c = summary["counters"]
    return {"weight_sync": sync, "stalls": int(summary.get("generator_stalls", 0)), "rl_seconds": rl["seconds"], "sampled_tokens_per_s": c["tokens/sampled"] / rl["seconds"],
            "replica_stall_max_s": summary["generator_stall_s_max"],
            "fleet_pause_max_s": c.get("weights/fleet_pause_s_max", 0.0), "fleet_pauses": int(c.get("weights/fleet_pauses", 0)),
            "requests_per_replica": summary["generator_requests"],
            "generator_busy": round(summary["generator_busy_fraction"], 2),
            "trainer_busy": round(summary["trainer_busy_fraction"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--work", default="bench/.work/rolling")
    a = ap.parse_args()
    rows = []
    for rep in range(a.repeats):
        for sync in ("rolling", "pause"):
            rows.append({"repeat": rep, **one(Path(a.work) / f"{sync}-{rep}", a.steps, sync, a.prompts, a.group)})
            print(rows[-1], flush=True)
    med = {s: {k: median(r[k] for r in rows if r["weight_sync"] == s)
               for k in ("sampled_tokens_per_s", "replica_stall_max_s", "fleet_pause_max_s")} for s in ("rolling", "pause")}
    emit(f"rolling_update_{a.prompts}x{a.group}", rows, {"prompts": a.prompts, "group": a.group, "median": med,
                                                         "tokens_per_s_rolling_vs_pause":
                                  med["rolling"]["sampled_tokens_per_s"] / med["pause"]["sampled_tokens_per_s"]})


if __name__ == "__main__":
    main()
