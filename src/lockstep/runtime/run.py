"""`lockstep run`: start Ray, build the components, run the stages, write the run directory.

A run's progress is its *position* (stage, step, data cursor, evaluations, counters and the
ledger snapshot), committed inside every trainer checkpoint. `--resume DIR` (and recovery from
a crashed trainer) loads the newest complete checkpoint and continues from its position.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import ray

from lockstep.config import ConfigError, RunSpec, to_dict
from lockstep.config.types import StageSpec
from lockstep.monitor.metrics import MetricsLogger
from lockstep.runtime import controller as ctl
from lockstep.runtime.balancer import ThreadBalancer
from lockstep.runtime.ledger import Ledger
from lockstep.runtime.plan import Plan, make_plan
from lockstep.runtime.types import RolloutRequest

REBALANCE_EVERY = 25
"""RL steps between thread-budget decisions (asynchronous stages only)."""

PREEMPT = threading.Event()
"""Set (by SIGTERM, see `lockstep run`) to checkpoint at the next step boundary and stop."""


class Preempted(Exception):
    """The run checkpointed and stopped on request; `--resume` continues it."""


def preempt_on_sigterm() -> None:
    """SIGTERM sets PREEMPT. Installed after ray.init, which replaces the SIGTERM handler with its
    own (that one exits at once, losing the steps since the last checkpoint)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: PREEMPT.set())


MAX_ROLLBACKS = 16
"""Rollbacks to a checkpoint after component losses before a run gives up (each also spends a
Ray restart, so runtime.max_restarts bounds them first)."""


def check_losses(spec: RunSpec) -> None:
    """Fail before any work on a loss the registry does not have (the config layer is torch-free,
    so it cannot look the registry up itself)."""
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
    if not Path(spec.model.path, "config.json").is_file():
        raise ConfigError(f"model.path: {spec.model.path!r} is not a Hugging Face model directory (no config.json)")
    return spec.model.path


def make_env_suite(spec: RunSpec, model_path: str):
    """The env suite and every stage's data, read before any work (bad data fails here)."""
    from transformers import AutoTokenizer

    from lockstep.envs.registry import make_suite
    from lockstep.envs.types import EnvError

    try:
        suite = make_suite(spec.env, AutoTokenizer.from_pretrained(model_path), seed=spec.seed)
        data = {i: (suite.sft(s.batch_size, s.dataset) if s.kind == "sft" else suite.train(s.prompts_per_step))
                for i, s in enumerate(spec.stages)}
    except EnvError as e:
        raise ConfigError(f"env: {e}") from None
    return suite, data


def start_ray(plan: Plan) -> None:
    """Join `plan.ray_address`, or start a loopback-only Ray that dies with this process (raylocal)."""
    from lockstep import raylocal

    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore",
                        "MKL_CBWR": os.environ.get("MKL_CBWR", "AUTO,STRICT")}}  # see engine/invariant.py
    raylocal.init(plan.ray_address or "", runtime_env=env, log_to_driver=False, num_cpus=plan.num_cpus)


def actor_name(run_dir: Path, role: str) -> str:
    """Actors are named per run directory, so tools (and tests) can find them."""
    return f"lockstep:{Path(run_dir).resolve()}:{role}"


def build(spec: RunSpec, plan: Plan, model_path: str, run_dir: Path) -> ctl.Components:
    from lockstep.runtime.actors import EnvWorker, GeneratorActor, TrainerActor

    m, r = spec.model, spec.runtime
    opts = {"max_restarts": r.max_restarts, "max_task_retries": 0}
    name = lambda role: actor_name(run_dir, role)  # noqa: E731
    trainer = TrainerActor.options(num_cpus=plan.trainer_cpus, name=name("trainer"), **opts).remote(
        model_path, m.lora_rank, m.lora_alpha, r.trainer_threads)
    generator = GeneratorActor.options(num_cpus=plan.generator_cpus, name=name("generator"), **opts).remote(
        model_path, m.lora_rank, m.lora_alpha, r.generator_threads)
    envs = [EnvWorker.options(num_cpus=plan.env_cpus, name=name(f"env{i}"), **opts).remote(
        model_path, name("generator"), retries=spec.env.retries, timeout_s=spec.env.timeout_s, call_timeout_s=r.call_timeout_s)
        for i in range(r.env_workers)]
    c = ctl.Components(trainer, generator, envs, r.call_timeout_s)
    c.note_incarnations()  # also surfaces start-up errors early
    return c


def latest_checkpoint(run_dir: Path) -> Path | None:
    from lockstep.engine.checkpoint_io import is_complete

    for path in sorted((run_dir / "checkpoints").glob("step-*"), reverse=True):
        if is_complete(path):
            return path
    return None


class Run:
    """One run directory, its position, and the stages."""

    def __init__(self, spec: RunSpec, plan: Plan, run_dir: Path, progress, suite, data, c: ctl.Components):
        self.spec, self.plan, self.dir, self.progress = spec, plan, Path(run_dir), progress
        self.suite, self.data, self.c = suite, data, c
        self.heldout = list(suite.heldout())
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(json.dumps(to_dict(spec), indent=2))
        self.metrics: MetricsLogger | None = None
        self.ledger: Ledger | None = None
        self.loop: ctl.RLLoop | None = None
        self.t0 = time.time()

    # -- position ----------------------------------------------------------------------------
    def _open(self, position: dict, ledger: Ledger, *, keep_through: int) -> None:
        for sink in (self.metrics, self.ledger):
            if sink is not None:
                sink.close()
        self.pos, self.ledger, self.loop = position, ledger, None
        self.metrics = MetricsLogger(self.dir, keep_through=keep_through)
        self.c.stats.clear()
        self.c.stats.update(position["counters"])
        self.t0 = time.time() - position["elapsed"]

    def fresh(self) -> None:
        """Start from the base model (a trainer lost before any checkpoint also lands here)."""
        log = self.dir / "ledger.jsonl"
        if log.exists():  # a restart from nothing: the log says so, and the audit starts over
            Ledger.restore({"trained": {}, "filtered": {}, "pending": []}, log, resumed_from="").close()
        self.c.publish()
        self._open({"stage": 0, "stage_step": 0, "global_step": 0, "elapsed": 0.0, "stage_elapsed": 0.0,
                    "accs": {}, "evals": [], "stage_rows": [], "counters": {}, "rl": None}, Ledger(log), keep_through=-1)
        self.pos["accs"]["eval_accuracy_start"] = self.evaluate("start")

    def restore(self, ckpt: Path) -> None:
        pos = ctl.wait(self.c.trainer.load_state.remote(str(ckpt)), self.c.timeout, "trainer.load_state")
        self.c.publish()
        ledger = Ledger.restore(pos.pop("ledger"), self.dir / "ledger.jsonl", resumed_from=ckpt.name)
        self._open(pos, ledger, keep_through=pos["global_step"])
        self.c.stats["runtime/resumes"] += 1

    def checkpoint(self) -> None:
        p = self.pos
        p["elapsed"], p["counters"] = time.time() - self.t0, dict(self.c.stats)
        if self.loop is not None:
            p["rl"] = self.loop.position()
        name = f"step-{p['global_step']:06d}"
        position = {**p, "ledger": self.ledger.checkpoint(name)}
        ctl.wait(self.c.trainer.save_state.remote(str(self.dir / "checkpoints" / name), position), self.c.timeout,
                 "trainer.save_state")
        keep = self.spec.runtime.keep_checkpoints
        for old in sorted((self.dir / "checkpoints").glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def maybe_checkpoint(self) -> None:
        every = self.spec.runtime.checkpoint_every
        if PREEMPT.is_set():
            self.checkpoint()
            raise Preempted(f"checkpointed at step {self.pos['global_step']}")
        if every and self.pos["global_step"] % every == 0:
            self.checkpoint()

    def _end_stage(self, kind: str, started: float, busy0, steps: int, samples: int) -> None:
        """Per-stage throughput and idle fractions, then a checkpoint at the stage boundary."""
        secs = time.time() - started
        (g, t), (g0, t0) = self._busy(), busy0
        self.pos["stage_rows"].append({
            "stage": kind, "seconds": round(secs, 1), "steps": steps, "steps_per_s": round(steps / secs, 2),
            "samples_per_s": round(samples / secs, 1),
            "generator_idle": round(1 - (g - g0) / secs, 2), "trainer_idle": round(1 - (t - t0) / secs, 2),
        })
        self.pos.update(stage=self.pos["stage"] + 1, stage_step=0, stage_elapsed=0.0, rl=None)
        self.loop = None
        self.checkpoint()

    # -- measurements ------------------------------------------------------------------------
    def _busy(self) -> tuple[float, float]:
        return self.c.stat("generator")["busy_s"], self.c.stat("trainer")["busy_s"]

    def _rollout_all(self, group_size: int, temperature: float) -> list:
        """The held-out set, spread over the env workers, under the newest published weights."""
        envs, b = self.c.envs, self.heldout
        chunks = [b[i :: len(envs)] for i in range(len(envs))]
        reqs = [RolloutRequest(tuple(x.group_id for x in ch), tuple(ch), group_size, temperature, 12345)
                for ch in chunks if ch]
        results = self.c.call(lambda: [e.rollout.remote(r) for e, r in zip(envs, reqs)], "evaluation")
        return [g for groups in results for g in groups]

    def evaluate(self, stage: str, *, pass_k: int = 0) -> float:
        t = time.perf_counter()
        groups = self._rollout_all(1, 0.0)
        acc = sum(s.correct for g in groups for s in g.samples) / max(1, len(groups))
        record = {"eval/accuracy": acc, "eval/stage": stage}
        if pass_k:
            sampled = self._rollout_all(pass_k, 1.0)
            record[f"eval/pass@{pass_k}"] = sum(any(s.correct for s in g.samples) for g in sampled) / max(1, len(sampled))
        self.pos["eval_seconds"] = self.pos.get("eval_seconds", 0.0) + time.perf_counter() - t
        self.pos["evals"].append({"step": self.pos["global_step"], "stage": stage, "time": time.time() - self.t0,
                                  "eval_seconds_so_far": self.pos["eval_seconds"], "accuracy": acc,
                                  **{k.split("/")[1]: v for k, v in record.items() if "@" in k}})
        self.metrics.log(self.pos["global_step"], record)
        return acc

    def set_threads(self, trainer: int, generator: int) -> None:
        """The thread budget per stage: on a CPU box, cores are the resource to balance."""
        self.c.set_threads(trainer, generator)
        self.metrics.log(self.pos["global_step"], {"placement/trainer_threads": trainer,
                                                   "placement/generator_threads": generator})

    def rebalance(self, balancer: ThreadBalancer, window: dict) -> None:
        """End a window of REBALANCE_EVERY steps: log how busy each stage was and the step rate,
        and switch to the thread plan the balancer picks from the measured rates."""
        now, busy = time.time(), self._busy()
        secs = now - window["since"]
        gen, tr = (busy[0] - window["busy"][0]) / secs, (busy[1] - window["busy"][1]) / secs
        rate = REBALANCE_EVERY / secs
        self.metrics.log(self.pos["global_step"], {"placement/generator_busy": gen, "placement/trainer_busy": tr,
                                                   "placement/steps_per_s": rate})
        plan = balancer.next_plan(rate)
        if plan != self.c.threads:
            self.set_threads(*plan)
        window.update(since=time.time(), busy=self._busy())

    # -- stages ------------------------------------------------------------------------------
    def sft(self, stage: StageSpec, index: int) -> float:
        from lockstep.engine.types import Datum

        cpus = self.plan.num_cpus
        self.set_threads(cpus, cpus)  # only the trainer works (the generator only evaluates)
        acc = self.pos["evals"][-1]["accuracy"]
        started, busy0, first = time.time(), self._busy(), self.pos["stage_step"]
        for k in range(first, stage.steps):
            data = [Datum.from_tokens(e.prompt + e.completion, weights=[0.0] * (len(e.prompt) - 1) + [1.0] * len(e.completion))
                    for e in self.data[index].get_batch(k)]
            metrics = ctl.wait(self.c.trainer.train.remote(data, "cross_entropy", ctl.adam(stage)), self.c.timeout,
                               "trainer.train")
            self.c.stats["tokens/trained"] += sum(len(d.model_input) for d in data)
            self.pos["global_step"] += 1
            self.pos["stage_step"] = k + 1
            self.metrics.log(self.pos["global_step"], {"stage": index, "train/loss_sum": metrics["loss:sum"],
                                                       "train/grad_norm": metrics["grad_norm:mean"],
                                                       "train/entropy": metrics.get("entropy:mean")})
            self.progress(self.pos["global_step"], f"sft {k + 1}/{stage.steps}", acc)
            if (k + 1) % stage.eval_every == 0 or k + 1 == stage.steps:
                self.c.publish()
                acc = self.evaluate("sft")
                if stage.target_accuracy and acc >= stage.target_accuracy:
                    break
            self.maybe_checkpoint()
        self.c.publish()
        if self.spec.env.pass_k:
            acc = self.evaluate("sft", pass_k=self.spec.env.pass_k)
        steps = self.pos["stage_step"] - first
        self.pos["accs"]["eval_accuracy_after_sft"] = acc
        self._end_stage("sft", started, busy0, steps, steps * stage.batch_size)
        return acc

    def _rl_record(self, index: int, batch, metrics: dict, counts: dict, step_s: float) -> dict:
        rewards = [s.reward for g in batch for s in g.samples]
        tokens = sum(len(s.tokens) for g in batch for s in g.samples)
        record = {"stage": index, "train/loss_sum": metrics["loss:sum"], "train/grad_norm": metrics["grad_norm:mean"],
                  "train/entropy": metrics.get("entropy:mean"), "rollout/reward_mean": sum(rewards) / len(rewards),
                  "rollout/accuracy": sum(s.correct for g in batch for s in g.samples) / len(rewards),
                  "time/step_s": step_s, "time/trainer_busy_s": metrics["trainer_busy_s:sum"],
                  "throughput/samples_per_s": len(rewards) / step_s, "throughput/sampled_tokens_per_s": tokens / step_s,
                  **counts}
        record.update({f"loss/{k.split(':')[0]}": v for k, v in metrics.items()
                       if k.split(":")[0] in ("importance_ratio", "clip_fraction")})
        record.update({f"mismatch/{k.split(':')[0].removeprefix('mismatch_')}": v for k, v in metrics.items()
                       if k.startswith("mismatch_")})
        return record

    def rl(self, stage: StageSpec, index: int) -> float:
        cpus = self.plan.num_cpus
        balancer = ThreadBalancer(cpus)
        if stage.max_staleness == 0:  # synchronous: the stages take turns, each may use every core
            self.set_threads(cpus, cpus)
        else:  # concurrent: the plan is chosen by measured step rate
            self.set_threads(*balancer.current)
        started = time.time() - self.pos["stage_elapsed"]
        busy0 = self._busy()
        window = {"since": time.time(), "busy": busy0}
        self.loop = ctl.RLLoop(self.c, stage, index, self.data[index], self.ledger, seed=self.spec.seed,
                               position=self.pos["rl"])
        first = self.loop.step
        state = {"acc": self.pos["evals"][-1]["accuracy"], "last": time.perf_counter()}

        def on_step(step, batch, metrics, counts):
            now = time.perf_counter()
            self.pos["global_step"] += 1
            self.pos["stage_step"], self.pos["stage_elapsed"] = step, time.time() - started
            record = self._rl_record(index, batch, metrics, counts, now - state["last"])
            self.c.stats["tokens/trained"] += sum(len(g.prompt) + len(x.tokens) for g in batch for x in g.samples)
            state["last"] = now
            self.metrics.log(self.pos["global_step"], record)
            if step % stage.eval_every == 0:
                state["acc"] = self.evaluate("rl")
            if stage.max_staleness > 0 and step % REBALANCE_EVERY == 0:
                self.rebalance(balancer, window)
            self.progress(self.pos["global_step"], f"rl {step}/{stage.steps}", state["acc"], reward=record["rollout/reward_mean"])
            self.maybe_checkpoint()

        def should_stop(step):
            if stage.max_seconds and time.time() - started > stage.max_seconds:
                return True
            return bool(stage.target_accuracy and state["acc"] >= stage.target_accuracy)

        steps = ctl.rl_stage(self.loop, on_step, should_stop) - first
        self.evaluate("rl", pass_k=self.spec.env.pass_k)
        for g in self.loop.pending_ids():  # the stage is over: what is still in flight is not needed
            self.ledger.filtered([g], "stage_ended")
        self._end_stage("rl", started, busy0, steps, steps * stage.prompts_per_step * stage.group_size)
        return self.pos["evals"][-1]["accuracy"]

    def execute(self) -> dict:
        for i in range(self.pos["stage"], len(self.spec.stages)):
            stage = self.spec.stages[i]
            self.sft(stage, i) if stage.kind == "sft" else self.rl(stage, i)
        return self.finish()

    def finish(self) -> dict:
        c, p = self.c, self.pos
        ctl.wait(c.trainer.save_state.remote(str(self.dir / "checkpoints" / "final"), {**p, "done": True,
                 "ledger": self.ledger.checkpoint("final")}), c.timeout, "save")
        ctl.wait(c.trainer.export.remote(str(self.dir / "final_model")), c.timeout, "export")
        gen, tr = c.stat("generator"), c.stat("trainer")
        wall = time.time() - self.t0
        accs = dict(p["accs"])
        accs.setdefault("eval_accuracy_after_sft", accs["eval_accuracy_start"])
        accs["eval_accuracy_final"] = p["evals"][-1]["accuracy"]
        pass_k = [e for e in p["evals"] if any("@" in k for k in e)]
        summary = {**accs, "wall_seconds": wall, "steps": p["global_step"], "evals": p["evals"],
                   **({f"eval_pass@{self.spec.env.pass_k}_final": pass_k[-1][f"pass@{self.spec.env.pass_k}"]} if pass_k else {}),
                   "generator_busy_fraction": gen["busy_s"] / wall, "trainer_busy_fraction": tr["busy_s"] / wall,
                   "weight_swap_latency_s_max": gen["swap_latency_s_max"], "counters": dict(c.stats),
                   "ledger": self.ledger.counts(), "stages": p["stage_rows"],
                   "data": {k: vars(v) for k, v in self.suite.data_reports.items()}}
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.metrics.close()
        self.ledger.close()
        from lockstep.monitor.report import write_report

        write_report(self.dir, summary)
        return summary


def run(spec: RunSpec, run_dir: Path, progress=lambda *a, **k: None, *, resume: bool = False,
        preemptible: bool = False) -> dict:
    """Run `spec` into `run_dir`; with `resume`, continue it from its newest checkpoint. With
    `preemptible`, SIGTERM checkpoints at the next step and raises Preempted."""
    check_losses(spec)
    plan = make_plan(spec)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model_path = resolve_model(spec)
    suite, data = make_env_suite(spec, model_path)
    run_dir = Path(run_dir)
    if resume and (run_dir / "checkpoints" / "final").is_dir() and (run_dir / "summary.json").is_file():
        return json.loads((run_dir / "summary.json").read_text())  # already complete
    if not resume and (run_dir / "ledger.jsonl").exists():
        raise ConfigError(f"{run_dir} already holds a run; continue it with --resume {run_dir} or pick another --run-dir")
    start_ray(plan)
    if preemptible:
        preempt_on_sigterm()
    c = build(spec, plan, model_path, run_dir)
    r = Run(spec, plan, run_dir, progress, suite, data, c)
    try:
        ckpt = latest_checkpoint(run_dir) if resume else None
        r.restore(ckpt) if ckpt else r.fresh()
        for _ in range(MAX_ROLLBACKS):
            try:
                return r.execute()
            except ctl.TrainerLost:  # Ray restarted the trainer: continue from the last checkpoint
                pass
            except ctl.ComponentError as e:  # a loss outside the RL loop's own replay path
                if not ctl.is_component_loss(e):
                    raise
                try:
                    c.recover()
                except ctl.TrainerLost:
                    pass
            ckpt = latest_checkpoint(run_dir)
            r.restore(ckpt) if ckpt else r.fresh()
        raise ctl.ComponentError(f"gave up after {MAX_ROLLBACKS} rollbacks to a checkpoint")
    finally:
        for actor in c.actors().values():
            ray.kill(actor)
