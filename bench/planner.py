"""The planner's predictions next to this machine's measured times (issue 19 point 4).

    .venv/bin/python bench/planner.py [--threads 1,2] [--repeats 5] [--rl-seconds 60]

Parts 1-2 write bench/results/planner_engine.json, part 3 planner_rl.json (--threads "" or
--rl-seconds 0 skips one).

1. Train step: the built-in model, 32 x 128 tokens in one micro-batch, forward_backward
   (cross-entropy) + optim_step: BENCHMARKS section 3's step.
2. Sampler: 64 prompts x 64 new tokens, temperature 1, no stops: section 1's batch.
   For both, the planner first calibrates this CPU at that thread count (calibrate.py: the
   engine's products at the model's shapes, memory bandwidth, the engine's fixed costs at small
   sizes; the best of repeats, since contention only adds time) and predicts; then the engine
   runs: the median of --repeats after a warm-up, and the best of as many more.
3. One RL step, synchronous (rl.max_staleness=0) and asynchronous (2): `lockstep run` of
   bench/configs/rl_only.toml from the warmed-up model (bench/rl_common.py), runtime.cpus=2, for
   --rl-seconds, no evaluations, the allocator off (the planner predicts the configured 1 + 1
   threads); measured: the median of time/step_s. Predicted by plan_run for the same config at its
   own staleness bound (pin_staleness), as the config states it (every group with reward signal),
   and with the share of groups without signal the run measured (filter/zero_variance over the
   groups its rollout batches drew: the runtime draws more batches until a step is full,
   planner/loop.py); and the trainer's busy time per step (time/trainer_busy_s) against the
   predicted train step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, "bench")
from common import emit  # noqa: E402
from rl_common import LOCKSTEP, ROOT, warm_model  # noqa: E402

from lockstep.config import load  # noqa: E402
from lockstep.planner import cpu_cluster, plan_run  # noqa: E402
from lockstep.planner.calibrate import BuiltinEngine, calibrate_cpu  # noqa: E402
from lockstep.planner.cost import generate_batch, trainer_step  # noqa: E402
from lockstep.planner.shapes import builtin_shape, spec_workload  # noqa: E402
from lockstep.planner.types import TrainLayout, Workload  # noqa: E402

TRAIN_B, TRAIN_T = 32, 128
SAMPLE_ROWS, SAMPLE_PROMPT, SAMPLE_NEW = 64, 8, 64


def engine_rows(threads: int, repeats: int) -> list[dict]:
    shape = builtin_shape()
    torch.set_num_threads(threads)
    device = calibrate_cpu(shape, threads=threads, train_rows=TRAIN_B * TRAIN_T, decode_rows=SAMPLE_ROWS,
                           repeats=repeats)
    engine = BuiltinEngine()
    train_pred = trainer_step(shape, Workload("sft", TRAIN_B, TRAIN_T, 0), device, TrainLayout(micro_batch=TRAIN_B))
    train_meas = engine.train_step_s(TRAIN_B, TRAIN_T, repeats)
    train_best = engine.train_step_s(TRAIN_B, TRAIN_T, repeats, best=True)
    gen_pred = generate_batch(shape, Workload("rl", SAMPLE_ROWS, SAMPLE_PROMPT, SAMPLE_NEW), device, 1, SAMPLE_ROWS)
    gen_meas = engine.sample_s(SAMPLE_ROWS, SAMPLE_PROMPT, SAMPLE_NEW, repeats)
    gen_best = engine.sample_s(SAMPLE_ROWS, SAMPLE_PROMPT, SAMPLE_NEW, repeats, best=True)
    tokens = SAMPLE_ROWS * SAMPLE_NEW
    return [
        {"what": f"train step {TRAIN_B}x{TRAIN_T} (s)", "threads": threads, "predicted": train_pred.step_s,
         "measured": train_meas, "ratio": train_pred.step_s / train_meas, "measured_best": train_best,
         "ratio_best": train_pred.step_s / train_best},
        {"what": f"sampler {SAMPLE_ROWS}x{SAMPLE_NEW} (new tokens/s)", "threads": threads,
         "predicted": tokens / gen_pred.batch_s, "measured": tokens / gen_meas, "ratio": gen_meas / gen_pred.batch_s,
         "measured_best": tokens / gen_best, "ratio_best": gen_best / gen_pred.batch_s},
    ]


def rl_run(model: Path, run_dir: Path, staleness: int, seconds: float) -> dict:
    """`lockstep run` of one RL stage; the median step and the groups sampled per step."""
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"model.path='{model}'", f"rl.max_staleness={staleness}", f"rl.max_seconds={seconds}",
                 "rl.target_accuracy=0", "rl.eval_every=100000", "env.pass_k=0", "runtime.cpus=2",
                 "runtime.allocator=false"]
    subprocess.run([*LOCKSTEP, "run", str(ROOT / "bench/configs/rl_only.toml"), "--run-dir", str(run_dir), *overrides],
                   check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step_s" in r][2:]  # the first steps include the pipeline's fill
    summary = json.loads((run_dir / "summary.json").read_text())
    batches = sum(1 for line in (run_dir / "trace.jsonl").read_text().splitlines() if '"generate"' in line)
    prompts = load(str(ROOT / "bench/configs/rl_only.toml"), overrides).stages[0].prompts_per_step
    return {"step_s": median(r["time/step_s"] for r in steps), "steps": len(steps),
            "trainer_busy_s": median(r["time/trainer_busy_s"] for r in steps), "rollout_batches": batches,
            "zero_variance": summary["counters"]["filter/zero_variance"] / (batches * prompts), "overrides": overrides}


def rl_rows(work_dir: Path, seconds: float) -> list[dict]:
    model = warm_model(work_dir)
    rows = []
    for staleness in (0, 2):
        run = rl_run(model, work_dir / f"planner-rl-{staleness}", staleness, seconds)
        spec = load(str(ROOT / "bench/configs/rl_only.toml"), run["overrides"])
        plain = plan_run(spec, cpu_cluster(2), pin_staleness=True)
        work = dataclasses.replace(spec_workload(spec), zero_variance=run["zero_variance"])
        real = plan_run(spec, cpu_cluster(2), workload=work, pin_staleness=True)
        kind = "sync" if staleness == 0 else f"async (staleness {staleness})"
        rows.append({"what": f"RL step, {kind}, as configured (s)", "threads": "1+1", "predicted": plain.step_s,
                     "measured": run["step_s"], "ratio": plain.step_s / run["step_s"]})
        rows.append({"what": f"RL step, {kind}, {run['zero_variance']:.0%} of groups without signal (s)",
                     "threads": "1+1", "predicted": real.step_s, "measured": run["step_s"],
                     "ratio": real.step_s / run["step_s"]})
        rows.append({"what": f"RL step, {kind}: trainer busy per step (s)", "threads": "1+1",
                     "predicted": real.train.step_s, "measured": run["trainer_busy_s"],
                     "ratio": real.train.step_s / run["trainer_busy_s"]})
        print(json.dumps({"staleness": staleness, **run, "plan": real.as_dict()}), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rl-seconds", type=float, default=60.0)
    ap.add_argument("--work", default="bench/.work")
    a = ap.parse_args()
    # Each part writes its own table and bench/results/planner_<part>.json as soon as it ends.
    if a.threads:
        emit("planner_engine", [row for t in a.threads.split(",") for row in engine_rows(int(t), a.repeats)],
             {"load_average": os.getloadavg()})
    torch.set_num_threads(1)
    if a.rl_seconds > 0:
        emit("planner_rl", rl_rows(Path(a.work).resolve(), a.rl_seconds), {"load_average": os.getloadavg()})


if __name__ == "__main__":
    main()
