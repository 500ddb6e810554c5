"""The parallel-strategy planner: a cost model and an event simulation of the RL step, searched for
the fastest strategy that fits (docs/planner.md).

    plan_run(spec)                    this machine's CPU (measured), the config's own engine knobs
    plan_run(spec, parse_gpus("H100-SXM:16"))   a GPU cluster, everything searched but pinned counts

Torch is imported only to measure this CPU (calibrate.py).
"""

from __future__ import annotations

import os
from dataclasses import replace

from lockstep.config.types import RunSpec
from lockstep.planner.devices import GPUS, gpu, parse_gpus
from lockstep.planner.search import Pinned, plan_cpu, plan_gpus
from lockstep.planner.shapes import spec_shape, spec_workload
from lockstep.planner.types import Cluster, Device, ModelShape, PlanRefused, Strategy, Workload

__all__ = ["GPUS", "Cluster", "Device", "ModelShape", "PlanRefused", "Strategy", "Workload", "cpu_cluster", "gpu",
           "parse_gpus", "plan_run"]

UNMEASURED_CPU = Device("this machine's CPU (measured when planned)", "cpu", flops=0.0, memory=0.0, memory_bw=0.0,
                        link_bw=0.0, network_bw=0.0, per_node=1, bytes_per_param=4)


def cpu_cluster(cores: int) -> Cluster:
    """`cores` cores of this machine; the planner measures them (calibrate.py) when it plans."""
    return Cluster(UNMEASURED_CPU, cores)


def plan_run(spec: RunSpec, cluster: Cluster | None = None, *, model_config: str | None = None,
             prompt_tokens: int | None = None, workload: Workload | None = None, pin_staleness: bool = False) -> Strategy:
    """The planner's strategy for a run config: on `cluster` (GPUs), or on this machine's CPU
    (`runtime.cpus` cores, or all). Raises PlanRefused naming the resource that does not suffice.
    The runtime can read `generator_replicas` of the result to resolve rollout.replicas = "auto".
    `workload` replaces the one read from the config (e.g. with the share of groups without signal
    a run measured). On a CPU, `pin_staleness` predicts the config's own staleness bound instead of
    searching below it (what a run with this config does)."""
    shape = spec_shape(spec, model_config)
    work = workload or spec_workload(spec, prompt=prompt_tokens)
    replicas = spec.rollout.replicas if isinstance(spec.rollout.replicas, int) else None
    if cluster is not None and cluster.device.kind == "gpu":
        pinned = Pinned(dp=spec.train.replicas) if spec.train.replicas > 1 else Pinned()
        return plan_gpus(shape, work, cluster.device, cluster.count, replicas=replicas, pinned=pinned)
    cores = cluster.count if cluster is not None else (spec.runtime.cpus or os.cpu_count() or 1)
    r = spec.runtime
    if replicas is not None and replicas > max(1, cores // r.generator_threads) and replicas > cores:
        raise PlanRefused("rollout.replicas", f"rollout.replicas={replicas}: this run has {cores} CPU core(s), "
                                              f"and each replica needs at least one; use at most {cores} or \"auto\"")
    micro = spec.train.micro
    train_rows = -(-work.sequences // micro) * work.seq_len
    decode_rows = work.sequences if replicas is None else -(-work.sequences // replicas)
    devices = {t: _measured(cluster, shape, t, train_rows, decode_rows) for t in {r.trainer_threads, r.generator_threads}}
    if work.kind == "rl" and not work.env_episode_s:
        work = replace(work, env_episode_s=_env_cost(spec))
    return plan_cpu(shape, work, trainer_device=devices[r.trainer_threads], generator_device=devices[r.generator_threads],
                    cores=cores, trainer_replicas=spec.train.replicas, trainer_threads=r.trainer_threads,
                    micro_batches=micro, generator_threads=r.generator_threads, replicas=replicas,
                    pin_staleness=pin_staleness)


def _env_cost(spec: RunSpec) -> float:
    """The config's env work per episode on this machine (0 where its suite cannot be built here,
    e.g. data not readable: the plan then leaves env time out, and says so in its notes)."""
    from lockstep.envs.types import EnvError
    from lockstep.planner.calibrate import env_episode_s

    if spec.model.path == "builtin":
        from lockstep.engine.tiny import ensure_tiny_model

        path = str(ensure_tiny_model())
    else:
        path = spec.model.path
    try:
        return env_episode_s(spec, path)
    except (EnvError, OSError):
        return 0.0


def _measured(cluster: Cluster | None, shape: ModelShape, threads: int, train_rows: int, decode_rows: int) -> Device:
    if cluster is not None and cluster.device.flops > 0:
        return cluster.device
    from lockstep.planner.calibrate import calibrate_cpu

    return calibrate_cpu(shape, threads=threads, train_rows=train_rows, decode_rows=decode_rows)
