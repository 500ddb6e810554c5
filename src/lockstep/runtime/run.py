"""`lockstep run`: start Ray, build the components, run the stages into the run directory.

The run directory and the run's position live in `rundir.py`, the stages in `stages.py`. This
module wires them: it checks the spec and data before any work, starts Ray and the actors, and
runs the stages, rolling back to the last checkpoint when the trainer is lost (Ray restarts it with
its state gone). Losing a generator or an env worker costs only its work (see controller.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import ray

from lockstep import memlimit
from lockstep.config import ConfigError, RunSpec
from lockstep.envs.datafile import BUDGET_ENV
from lockstep.runtime import controller as ctl
from lockstep.runtime import forwards
from lockstep.runtime.fleet import GeneratorFleet, replica_name
from lockstep.runtime.plan import Plan, make_plan
from lockstep.runtime.rundir import (PREEMPT, Preempted, actor_name, check_writer, latest_checkpoint, log,
                                     resume_checkpoint, writer_lock)
from lockstep.runtime.stages import Run

__all__ = ["PREEMPT", "Preempted", "actor_name", "check_losses", "latest_checkpoint", "run"]


def preempt_on_sigterm() -> None:
    """SIGTERM sets PREEMPT. Installed after ray.init, which replaces the SIGTERM handler with its
    own (that one exits at once, losing the steps since the last checkpoint)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: PREEMPT.set())


JOB_LIMITS_ENV = (memlimit.CGROUP_ENV, memlimit.RLIMIT_ENV, BUDGET_ENV)
"""Variables the job service sets on a job process that its Ray actors must see too."""
MAX_ROLLBACKS = 16
"""Rollbacks to a checkpoint after a lost trainer before a run gives up (each also spends a Ray
restart, so runtime.max_restarts bounds them first)."""


def check_losses(spec: RunSpec) -> None:
    """Fail before any work on a loss the engine's registry does not have (the config layer checks
    the built-in names; this also catches a registry that disagrees with them)."""
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
    # A service job's limits (its memory, its data budget) reach its actors too: they are the
    # raylet's children, not this process's, and join the job's memory limit as they start.
    env["env_vars"].update({k: os.environ[k] for k in JOB_LIMITS_ENV if k in os.environ})
    if memlimit.CGROUP_ENV in os.environ or memlimit.RLIMIT_ENV in os.environ:
        env["worker_process_setup_hook"] = "lockstep.memlimit.enter_from_env"
    gpus = {"num_gpus": plan.num_gpus} if plan.device == "cuda" else {}
    raylocal.init(plan.ray_address or "", runtime_env=env, log_to_driver=False, num_cpus=plan.num_cpus, **gpus)


def spread(plan: Plan) -> tuple[dict, list[dict]]:
    """Ray options placing the trainer on the head node and the generator side on the others
    (round robin; the head too when it is alone), as soft node affinity: Ray restarts an actor
    whose node is lost on any node left instead of waiting for that node forever."""
    if plan.placement != "spread":
        return {}, [{}]
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n["Alive"]]
    head = next((n for n in nodes if "node:__internal_head__" in n["Resources"]), nodes[0])
    others = [n for n in nodes if n is not head] or [head]
    on = lambda n: {"scheduling_strategy": NodeAffinitySchedulingStrategy(n["NodeID"], soft=True)}  # noqa: E731
    return on(head), [on(n) for n in others]


def env_worker(spec: RunSpec, model_path: str, run_dir: Path, role: str, num_cpus: float, **placement):
    """An EnvWorker of this run named `role`, rolling out through the run's generator replicas;
    also what the allocator starts mid-run."""
    from lockstep.runtime.actors import EnvWorker

    r = spec.runtime
    return EnvWorker.options(num_cpus=num_cpus, num_gpus=0, name=actor_name(run_dir, role), max_restarts=r.max_restarts,
                             max_task_retries=0, **placement).remote(
        model_path, actor_name(run_dir, ""), retries=spec.env.retries, timeout_s=spec.env.timeout_s,
        call_timeout_s=r.call_timeout_s, log_path=str(run_dir / "envs.log"))


def generator_replica(spec: RunSpec, model_path: str, run_dir: Path, index: int, num_cpus: float,
                      num_gpus: float = 0.0, **placement):
    """Generator replica `index` of this run (fleet.replica_name); also what the allocator starts mid-run."""
    from lockstep.runtime.actors import GeneratorActor

    m, r = spec.model, spec.runtime
    return GeneratorActor.options(num_cpus=num_cpus, num_gpus=num_gpus, name=actor_name(run_dir, replica_name(index)),
                                  max_restarts=r.max_restarts, max_task_retries=0, **placement).remote(
        model_path, m.lora_rank, m.lora_alpha, r.generator_threads, spec.rollout.speculative, m.device, m.dtype)


def build(spec: RunSpec, plan: Plan, model_path: str, run_dir: Path) -> ctl.Components:
    from lockstep.runtime.actors import TrainerActor

    m, r = spec.model, spec.runtime
    head, others = spread(plan)
    trainer = TrainerActor.options(num_cpus=plan.trainer_cpus, num_gpus=plan.trainer_gpus,
                                   name=actor_name(run_dir, "trainer"), max_restarts=r.max_restarts,
                                   max_task_retries=0, **head).remote(
        model_path, m.lora_rank, m.lora_alpha, r.trainer_threads, m.train_experts, plan.trainer_replicas,
        plan.micro_batches, plan.trainer_cpus, m.device, m.dtype, plan.trainer_gpus)
    generators = [generator_replica(spec, model_path, run_dir, i, plan.generator_cpus, plan.generator_gpus,
                                    **others[i % len(others)])
                  for i in range(plan.generator_replicas)]
    fleet = GeneratorFleet(generators, r.call_timeout_s, plan.weight_sync)
    envs = [env_worker(spec, model_path, run_dir, f"env{i}", plan.env_cpus, **others[i % len(others)])
            for i in range(plan.env_workers)]
    c = ctl.Components(trainer, fleet, envs, r.call_timeout_s, allow_mixed_forward=r.allow_mixed_forward)
    try:
        c.note_incarnations()  # also surfaces start-up errors early, and refuses mixed forwards
    except BaseException:
        stop(c)
        raise
    return c


def stop(c: ctl.Components) -> None:
    """Stop every actor of the run (those starting, retiring or draining too)."""
    c.fleet.close()
    for actor in c.every_actor():
        ray.kill(actor)


def write_forwards(c: ctl.Components, run_dir: Path) -> None:
    """forward.json: each component's forward fingerprint and how it differs from the trainer's
    (runtime/forwards.py); written at start and again when the run ends (replicas may have joined)."""
    (run_dir / "forward.json").write_text(json.dumps(forwards.report(c.forwards), indent=2) + "\n")


def _execute_with_rollbacks(r: Run, c: ctl.Components) -> dict:
    """Run the stages; when the trainer is lost, roll back to the last checkpoint (logged and
    counted in runtime/rollbacks) and go on. A generator or env worker lost anywhere is recovered
    where it happened; one that still reaches here is recovered and rolled back the same way."""
    for _ in range(MAX_ROLLBACKS):
        try:
            return r.execute()
        except ctl.TrainerLost as e:  # Ray restarted the trainer: continue from the last checkpoint
            why = str(e)
        except ctl.ComponentError as e:  # a loss outside every recovery path
            if not ctl.is_component_loss(e):
                raise
            why = str(e)
            try:
                c.recover()
            except ctl.TrainerLost:
                pass
        ckpt = latest_checkpoint(r.dir)
        log.warning("rolling back to %s after: %s", ckpt.name if ckpt else "the base model", why)
        c.stats["runtime/rollbacks"] += 1
        r.start(ckpt)
    raise ctl.ComponentError(f"gave up after {MAX_ROLLBACKS} rollbacks to a checkpoint")


def run(spec: RunSpec, run_dir: Path, progress=lambda *a, **k: None, *, resume: bool = False,
        preemptible: bool = False) -> dict:
    """Run `spec` into `run_dir`; with `resume`, continue it from its newest checkpoint. With
    `preemptible`, SIGTERM checkpoints at the next step and raises Preempted. RunDirError when a
    live process is writing `run_dir` (this run holds its writer lock from its first write on)."""
    run_dir = Path(run_dir)
    check_writer(run_dir)  # first: a live run's directory is refused as such, whatever else is wrong
    check_losses(spec)
    plan = make_plan(spec)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model_path = resolve_model(spec)
    suite, data = make_env_suite(spec, model_path)
    if resume and (run_dir / "checkpoints" / "final").is_dir() and (run_dir / "summary.json").is_file():
        return json.loads((run_dir / "summary.json").read_text())  # already complete
    _check_fresh(run_dir, resume)
    ckpt = resume_checkpoint(run_dir) if resume else None  # refuses, before any write, if every one is torn
    with writer_lock(run_dir):
        _check_fresh(run_dir, resume)  # (again: a run may have started and ended here since)
        start_ray(plan)
        if preemptible:
            preempt_on_sigterm()
        run_dir.mkdir(parents=True, exist_ok=True)  # the env workers open envs.log in it
        c = build(spec, plan, model_path, run_dir)
        # Where each actor started (Ray node ids); summary.json has where each ended.
        (run_dir / "nodes.json").write_text(json.dumps(c.nodes, indent=2) + "\n")
        write_forwards(c, run_dir)
        r = Run(spec, plan, run_dir, progress, suite, data, c)
        try:
            r.start(ckpt)
            summary = _execute_with_rollbacks(r, c)
            write_forwards(c, run_dir)
            return summary
        finally:
            stop(c)


def _check_fresh(run_dir: Path, resume: bool) -> None:
    if not resume and (run_dir / "ledger.jsonl").exists():
        raise ConfigError(f"{run_dir} already holds a run; continue it with --resume {run_dir} or pick another --run-dir")
