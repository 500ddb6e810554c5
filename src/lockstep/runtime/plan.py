"""The resolved placement plan: what `--dry-run` prints before any work starts."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import asdict, dataclass

from lockstep.config.types import ConfigError, RunSpec, StageSpec


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
    device: str = "cpu"
    """model.device: where the trainer and the generator replicas compute (env workers: CPU only)."""
    num_gpus: int = 0
    """GPUs the run may use (runtime.gpus, or the machine's); 0 on CPU."""
    trainer_gpus: float = 0.0
    generator_gpus: float = 0.0
    """Ray GPUs per trainer replica and per generator replica: a whole GPU each when there are
    enough, else a fraction that packs them onto the GPUs there are (see gpu_shares)."""

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


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, found without CUDA (this process never imports torch):
    CUDA_VISIBLE_DEVICES when set, else the driver's list."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [d.strip() for d in listed.split(",") if d.strip()]
        return len(ids[: ids.index("-1")] if "-1" in ids else ids)  # CUDA stops at an invalid id
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def gpu_shares(gpus: int, trainers: int, generators: int) -> tuple[float, float]:
    """(GPUs per trainer replica, per generator replica). A GPU each when there are enough; else one
    trainer and the generators share them evenly, as fractions that pack (1/k of a GPU with k
    processes per GPU: Ray never splits a fraction over two GPUs, so 0.75 each would strand one).
    Data-parallel trainer ranks cannot share a GPU (NCCL refuses two ranks on one device)."""
    require_gpus(gpus, "model.device", "set runtime.gpus when the GPUs are on the nodes of the cluster at "
                 "runtime.ray_address, or set model.device = 'cpu'")
    if gpus >= trainers + generators:
        return 1.0, 1.0
    if trainers > 1:
        raise ConfigError(f"train.replicas = {trainers} on GPUs needs a GPU for each trainer replica and at least "
                          f"one more for the {generators} generator replica(s); the run has {gpus} GPU(s): lower "
                          "train.replicas or rollout.replicas, or add GPUs (runtime.gpus)")
    share = 1 / math.ceil((trainers + generators) / gpus)
    return share, share


def require_gpus(gpus: int, setting: str, otherwise: str) -> None:
    """A CUDA setting with no GPU is an error at start, never a CPU fallback; so is one without Triton."""
    if gpus <= 0:
        raise ConfigError(f"{setting} = 'cuda' but no GPU is visible here (CUDA_VISIBLE_DEVICES, "
                          f"/proc/driver/nvidia/gpus): run on a machine with an NVIDIA GPU, or {otherwise}")
    check_triton(setting)


def check_triton(setting: str = "model.device") -> None:
    if importlib.util.find_spec("triton") is None:
        raise ConfigError(f"{setting} = 'cuda' runs the engine's Triton kernels, and Triton is not installed: "
                          "pip install 'lockstep[gpu]' (or pip install triton) in this environment")


def make_plan(spec: RunSpec) -> Plan:
    r = spec.runtime
    budget = r.cpus or os.cpu_count() or 2
    replicas, (generators, most) = spec.train.replicas, generator_replicas(spec, budget)
    gpus, trainer_gpus, generator_gpus = 0, 0.0, 0.0
    if spec.model.device == "cuda":
        gpus = r.gpus if r.gpus >= 0 else visible_gpus()
        most = generators  # a replica takes a GPU share fixed at the start: the allocator adds none
        trainer_gpus, generator_gpus = gpu_shares(gpus, replicas, generators)
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
                most, envs, spec.rollout.weight_sync, r.placement, spec.model.device, gpus, trainer_gpus,
                generator_gpus)
