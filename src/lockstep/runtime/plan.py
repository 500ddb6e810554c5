"""The resolved placement plan: what `--dry-run` prints before any work starts."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from lockstep.config.types import RunSpec, StageSpec


@dataclass(frozen=True)
class Plan:
    ray_address: str
    num_cpus: int
    """CPUs given to a local Ray instance."""
    trainer_cpus: float
    generator_cpus: float
    env_cpus: float
    """Fractional Ray CPUs per actor: actors never wait on each other for a CPU slot (three
    `num_cpus=1` actors on a 2-CPU node would leave one pending forever)."""
    trainer_threads: int
    generator_threads: int
    stages: tuple[dict, ...]
    trainer_replicas: int = 1
    """Trainer processes (data parallel); each takes `trainer_cpus`."""
    micro_batches: int = 1
    generator_replicas: int = 1
    """Generator actors behind the router at the start; each takes `generator_cpus`."""
    max_generator_replicas: int = 1
    """How many the allocator may grow the fleet to (rollout.replicas = "auto"), else the same."""
    env_workers: int = 1
    """Env workers built with the run (see `env_workers`)."""
    weight_sync: str = "rolling"
    placement: str = "pack"

    def as_dict(self) -> dict:
        return asdict(self)


AUTO_CPUS_PER_GENERATOR = 4
"""rollout.replicas = "auto": one generator replica per this many CPUs of the budget (a replica's
decode steps use a few threads well; more go to a second replica's batch)."""


def generator_replicas(spec: RunSpec, budget: int) -> tuple[int, int]:
    """(replicas at the start, the most the allocator may run): with "auto", the most is
    rollout.max_replicas and one per CPU of the budget (a replica needs a thread)."""
    n, most = spec.rollout.replicas, spec.rollout.max_replicas
    if n != "auto":
        return n, n
    start = max(1, min(budget // AUTO_CPUS_PER_GENERATOR, most))
    return start, max(start, min(budget, most))


def stage_env_workers(stage: StageSpec, budget: int) -> int:
    """The most env workers an RL stage keeps busy at once: each rollout batch in flight
    (max_staleness + 1) is one call on one worker, so more than that only idle (at most one per CPU)."""
    return min(budget, stage.max_staleness + 1)


def busy_env_workers(spec: RunSpec, budget: int) -> int:
    """`stage_env_workers` of the config's busiest asynchronous stage (1 without one)."""
    return max([stage_env_workers(s, budget) for s in spec.stages if s.kind == "rl" and s.max_staleness > 0],
               default=1)


def env_workers(spec: RunSpec, budget: int) -> int:
    """runtime.env_workers; with the allocator on, at least `busy_env_workers`: a worker built with
    the run starts beside the others, one the allocator adds mid-run is a process start on the
    cores the loop is using (a window at 0.5x, BENCHMARKS.md §17), and retiring an idle one is free."""
    r = spec.runtime
    return max(r.env_workers, busy_env_workers(spec, budget)) if r.allocator else r.env_workers


def make_plan(spec: RunSpec) -> Plan:
    r = spec.runtime
    budget = r.cpus or os.cpu_count() or 2
    replicas, (generators, most) = spec.train.replicas, generator_replicas(spec, budget)
    envs = env_workers(spec, budget)
    share = budget / (generators + replicas + 0.25 * envs)  # each replica of both, the envs
    stages = []
    for s in spec.stages:
        if s.kind == "sft":
            stages.append({"kind": "sft", "steps": s.steps, "examples_per_step": s.batch_size,
                           "learning_rate": s.learning_rate})
        else:
            stages.append({"kind": "rl", "steps": s.steps, "prompts_per_step": s.prompts_per_step,
                           "group_size": s.group_size, "samples_per_step": s.prompts_per_step * s.group_size,
                           "max_staleness": s.max_staleness, "batches_in_flight": s.max_staleness + 1,
                           "loss": s.loss, "advantage": s.advantage, "learning_rate": s.learning_rate,
                           "max_seconds": s.max_seconds})
    down = lambda x: math.floor(x * 1000) / 1000  # noqa: E731 - rounded up, the shares could sum past the budget
    return Plan(r.ray_address, budget, down(share), down(share), down(0.25 * share),
                r.trainer_threads, r.generator_threads, tuple(stages), replicas, spec.train.micro, generators,
                most, envs, spec.rollout.weight_sync, r.placement)
