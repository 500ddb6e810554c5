"""`lockstep run`: start Ray, build the components, run the stages, write the run directory."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import ray

from lockstep.config import RunSpec, to_dict
from lockstep.config.types import StageSpec
from lockstep.monitor.metrics import MetricsLogger
from lockstep.runtime import controller as ctl
from lockstep.runtime.plan import Plan, make_plan


def check_losses(spec: RunSpec) -> None:
    """Fail before any work on a loss the registry does not have (the config layer is torch-free,
    so it cannot look the registry up itself)."""
    from lockstep.config import ConfigError
    from lockstep.losses import LossError, get_loss

    for i, stage in enumerate(spec.stages):
        if stage.kind == "rl":
            try:
                get_loss(stage.loss)
            except LossError as e:
                raise ConfigError(f"stages[{i}].loss: {e}") from None


def resolve_model(spec: RunSpec) -> str:
    if spec.model.path == "builtin":
        from lockstep.engine.tiny import ensure_tiny_model

        return str(ensure_tiny_model())
    return spec.model.path


def start_ray(plan: Plan) -> None:
    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}}
    if plan.ray_address:
        ray.init(address=plan.ray_address, runtime_env=env, log_to_driver=False)
    else:
        ray.init(num_cpus=plan.num_cpus, include_dashboard=False, runtime_env=env, log_to_driver=False,
                 configure_logging=False)


def build(spec: RunSpec, plan: Plan, model_path: str) -> ctl.Components:
    from transformers import AutoTokenizer

    from lockstep.envs.arithmetic import ArithmeticTask
    from lockstep.runtime.actors import EnvWorker, GeneratorActor, TrainerActor

    m, r = spec.model, spec.runtime
    trainer = TrainerActor.options(num_cpus=plan.trainer_cpus).remote(model_path, m.lora_rank, m.lora_alpha, r.trainer_threads)
    generator = GeneratorActor.options(num_cpus=plan.generator_cpus).remote(model_path, m.lora_rank, m.lora_alpha, r.generator_threads)
    envs = [EnvWorker.options(num_cpus=plan.env_cpus).remote(model_path, spec.env.max_tokens) for _ in range(r.env_workers)]
    task = ArithmeticTask(digits=spec.env.digits, seed=spec.seed, num_heldout=spec.env.num_heldout)
    c = ctl.Components(trainer, generator, envs, AutoTokenizer.from_pretrained(model_path), task, r.call_timeout_s)
    ctl.wait(trainer.stats.remote(), r.call_timeout_s, "trainer start")  # surface start-up errors early
    ctl.wait(generator.stats.remote(), r.call_timeout_s, "generator start")
    return c


REBALANCE_EVERY = 25
"""RL steps between thread-budget decisions (asynchronous stages only)."""


class Run:
    """One run directory and the bookkeeping around the stages."""

    def __init__(self, spec: RunSpec, plan: Plan, run_dir: Path, progress):
        self.spec, self.plan, self.dir, self.progress = spec, plan, run_dir, progress
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(json.dumps(to_dict(spec), indent=2))
        self.metrics = MetricsLogger(self.dir)
        self.t0 = time.time()
        self.global_step = 0
        self.evals: list[dict] = []
        self.stage_rows: list[dict] = []

    def _busy(self, c: ctl.Components) -> tuple[float, float]:
        g = ctl.wait(c.generator.stats.remote(), c.timeout, "generator.stats")["busy_s"]
        t = ctl.wait(c.trainer.stats.remote(), c.timeout, "trainer.stats")["busy_s"]
        return g, t

    def _stage_row(self, c, kind: str, started: float, busy0, steps: int, samples: int) -> None:
        """Per-stage throughput and idle fractions for summary.json and the report."""
        secs = time.time() - started
        g, t = self._busy(c)
        self.stage_rows.append({
            "stage": kind, "seconds": round(secs, 1), "steps": steps, "steps_per_s": round(steps / secs, 2),
            "samples_per_s": round(samples / secs, 1),
            "generator_idle": round(1 - (g - busy0[0]) / secs, 2), "trainer_idle": round(1 - (t - busy0[1]) / secs, 2),
        })

    def evaluate(self, c: ctl.Components, stage: str) -> float:
        acc = ctl.evaluate(c, self.spec.env.max_tokens)
        self.evals.append({"step": self.global_step, "stage": stage, "accuracy": acc, "time": time.time() - self.t0})
        self.metrics.log(self.global_step, {"eval/accuracy": acc, "eval/stage": stage})
        return acc

    def maybe_checkpoint(self, c: ctl.Components, position: dict) -> None:
        every = self.spec.runtime.checkpoint_every
        if every and self.global_step % every == 0:
            path = self.dir / "checkpoints" / f"step-{self.global_step:06d}"
            ctl.wait(c.trainer.save_state.remote(str(path), position), c.timeout, "trainer.save_state")

    def threads(self, c: ctl.Components, trainer: int, generator: int) -> None:
        """The thread budget per stage: on a CPU box, cores are the resource to balance."""
        ctl.wait(c.trainer.set_threads.remote(trainer), c.timeout, "trainer.set_threads")
        ctl.wait(c.generator.set_threads.remote(generator), c.timeout, "generator.set_threads")
        self.metrics.log(self.global_step, {"placement/trainer_threads": trainer, "placement/generator_threads": generator})

    def rebalance(self, c: ctl.Components, since: float, busy0: tuple[float, float]):
        """Give the stage that was busier over the last window every core, the other a quarter.

        Measured here (2 cores, async GRPO): the trainer is the bottleneck (~75% busy against the
        generator's ~40%), and 2+1 threads run 25 steps in 13.6 s against 17.7 s for 1+1; a
        middle "split evenly" band made the allocation oscillate, so there is none.
        """
        now, busy = time.time(), self._busy(c)
        gen, tr = (busy[0] - busy0[0]) / (now - since), (busy[1] - busy0[1]) / (now - since)
        cpus, minor = self.plan.num_cpus, max(1, self.plan.num_cpus // 4)
        if tr >= gen:
            self.threads(c, cpus, minor)
        else:
            self.threads(c, minor, cpus)
        self.metrics.log(self.global_step, {"placement/generator_busy": gen, "placement/trainer_busy": tr})
        return now, busy

    def sft(self, c: ctl.Components, stage: StageSpec, index: int) -> float:
        cpus = self.plan.num_cpus
        self.threads(c, cpus, cpus)  # only the trainer works (the generator only evaluates)
        acc = self.evals[-1]["accuracy"]
        started, busy0, k = time.time(), self._busy(c), -1
        for k in range(stage.steps):
            metrics = ctl.wait(c.trainer.train.remote(ctl.sft_datums(c, k, stage.batch_size), "cross_entropy",
                                                      ctl.adam(stage)), c.timeout, "trainer.train")
            self.global_step += 1
            self.metrics.log(self.global_step, {"stage": index, "train/loss_sum": metrics["loss:sum"],
                                                "train/grad_norm": metrics["grad_norm:mean"]})
            self.progress(self.global_step, f"sft {k + 1}/{stage.steps}", acc)
            if (k + 1) % stage.eval_every == 0 or k + 1 == stage.steps:
                c.publish()
                acc = self.evaluate(c, "sft")
                if stage.target_accuracy and acc >= stage.target_accuracy:
                    break
            self.maybe_checkpoint(c, {"stage": index, "step": k + 1})
        c.publish()
        self._stage_row(c, "sft", started, busy0, k + 1, (k + 1) * stage.batch_size)
        return acc

    def rl(self, c: ctl.Components, stage: StageSpec, index: int) -> float:
        cpus = self.plan.num_cpus
        if stage.max_staleness == 0:  # synchronous: the stages take turns, each may use every core
            self.threads(c, cpus, cpus)
        else:  # concurrent: split the cores so they do not oversubscribe
            self.threads(c, max(1, cpus // 2), max(1, cpus - cpus // 2))
        started, busy0 = time.time(), self._busy(c)
        state = {"acc": self.evals[-1]["accuracy"], "last": time.perf_counter(), "window": (time.time(), busy0)}

        def on_step(step, batch, metrics, counts):
            self.global_step += 1
            now = time.perf_counter()
            rewards = [s.reward for g in batch for s in g.samples]
            record = {"stage": index, "train/loss_sum": metrics["loss:sum"], "train/grad_norm": metrics["grad_norm:mean"],
                      "rollout/reward_mean": sum(rewards) / len(rewards),
                      "time/step_s": now - state["last"], "time/trainer_busy_s": metrics["trainer_busy_s:sum"], **counts}
            record.update({f"loss/{k.split(':')[0]}": v for k, v in metrics.items() if k.split(":")[0] in
                           ("importance_ratio", "clip_fraction")})
            record.update({f"mismatch/{k.split(':')[0].removeprefix('mismatch_')}": v for k, v in metrics.items()
                           if k.startswith("mismatch_")})
            state["last"] = now
            if step % stage.eval_every == 0:
                state["acc"] = self.evaluate(c, "rl")
            if stage.max_staleness > 0 and step % REBALANCE_EVERY == 0:
                state["window"] = self.rebalance(c, *state["window"])
            self.metrics.log(self.global_step, record)
            self.progress(self.global_step, f"rl {step}/{stage.steps}", state["acc"], reward=record["rollout/reward_mean"])
            self.maybe_checkpoint(c, {"stage": index, "step": step})

        def should_stop(step):
            if stage.max_seconds and time.time() - started > stage.max_seconds:
                return True
            return bool(stage.target_accuracy and state["acc"] >= stage.target_accuracy)

        steps = ctl.rl_stage(c, stage, self.spec, on_step, should_stop)
        self._stage_row(c, "rl", started, busy0, steps, steps * stage.prompts_per_step * stage.group_size)
        return self.evaluate(c, "rl")

    def finish(self, c: ctl.Components, accs: dict) -> dict:
        ctl.wait(c.trainer.save_state.remote(str(self.dir / "checkpoints" / "final"), {"done": True}), c.timeout, "save")
        ctl.wait(c.trainer.export.remote(str(self.dir / "final_model")), c.timeout, "export")
        gen_stats = ctl.wait(c.generator.stats.remote(), c.timeout, "generator.stats")
        tr_stats = ctl.wait(c.trainer.stats.remote(), c.timeout, "trainer.stats")
        wall = time.time() - self.t0
        summary = {**accs, "wall_seconds": wall, "steps": self.global_step, "evals": self.evals,
                   "generator_busy_fraction": gen_stats["busy_s"] / wall, "trainer_busy_fraction": tr_stats["busy_s"] / wall,
                   "weight_swap_latency_s_max": gen_stats["swap_latency_s_max"], "counters": dict(c.stats),
                   "stages": self.stage_rows}
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.metrics.close()
        from lockstep.monitor.report import write_report

        write_report(self.dir, summary)
        return summary


def run(spec: RunSpec, run_dir: Path, progress=lambda *a, **k: None) -> dict:
    check_losses(spec)
    plan = make_plan(spec)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model_path = resolve_model(spec)
    start_ray(plan)
    r = Run(spec, plan, run_dir, progress)
    c = build(spec, plan, model_path)
    c.publish()
    accs = {"eval_accuracy_start": r.evaluate(c, "start")}
    for i, stage in enumerate(spec.stages):
        acc = r.sft(c, stage, i) if stage.kind == "sft" else r.rl(c, stage, i)
        if stage.kind == "sft":
            accs["eval_accuracy_after_sft"] = acc
    accs["eval_accuracy_final"] = r.evals[-1]["accuracy"]
    accs.setdefault("eval_accuracy_after_sft", accs["eval_accuracy_start"])
    return r.finish(c, accs)
