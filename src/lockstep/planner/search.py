"""The search over strategies: every trainer layout and generator arrangement that fits in memory,
the generator:trainer split, the staleness bound; the fastest simulated step wins.

On GPUs everything is searched except what the caller pins (a published layout, or the config's
own replica counts). On this machine's CPU the engine's own knobs are taken from the config (trainer
replicas and threads, micro-batches, generator threads) and `rollout.replicas = "auto"` is searched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable

from lockstep.planner.cost import generate_batch, generator_memory, max_rows, trainer_step, weight_sync_s
from lockstep.planner.loop import rounds_per_step
from lockstep.planner.simulate import simulate
from lockstep.planner.types import (GIB, Device, GenerateCost, Memory, ModelShape, PlanRefused, Simulation, Strategy,
                                    TrainCost, TrainLayout, Workload)

TP_SIZES = (1, 2, 4, 8)
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
INTERLEAVE = (1, 2, 4, 8)
STALENESS_SLACK = 1.01
"""Of the staleness bounds within 1% of the fastest step, the smallest (the most on-policy) wins."""


@dataclass(frozen=True)
class Pinned:
    """Trainer fields fixed by the caller; None is searched."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    micro_batch: int | None = None
    interleave: int | None = None
    recompute: str | None = None


def _choices(pinned, searched: Iterable) -> tuple:
    return (pinned,) if pinned is not None else tuple(searched)


def trainer_layouts(shape: ModelShape, work: Workload, device: Device, devices: int, pinned: Pinned) -> list[TrainLayout]:
    out = []
    for tp in _choices(pinned.tp, (t for t in TP_SIZES if t <= device.per_node and shape.num_heads % t == 0)):
        for pp in _choices(pinned.pp, (p for p in range(1, shape.num_layers + 1) if (devices // tp) % p == 0)):
            dp = devices // (tp * pp)
            if dp * tp * pp != devices or (pinned.dp is not None and dp != pinned.dp) or dp > work.sequences:
                continue
            per_rank = math.ceil(work.sequences / dp)
            stage_layers = math.ceil(shape.num_layers / pp)
            for mb in _choices(pinned.micro_batch, (m for m in MICRO_BATCHES if m <= per_rank)):
                for v in _choices(pinned.interleave, (v for v in INTERLEAVE if v == 1 or (pp > 1 and stage_layers % v == 0))):
                    for recompute in _choices(pinned.recompute, ("none", "full")):
                        out.append(TrainLayout(dp=dp, tp=tp, pp=pp, micro_batch=mb, interleave=v, recompute=recompute))
    return out


def best_trainer(shape: ModelShape, work: Workload, device: Device, devices: int,
                 pinned: Pinned = Pinned()) -> tuple[TrainLayout, TrainCost, int, int]:
    """(layout, cost, considered, refused for memory); PlanRefused names the memory that is short."""
    layouts = trainer_layouts(shape, work, device, devices, pinned)
    if not layouts:
        raise PlanRefused("trainer devices", f"no trainer layout over {devices} {device.name} device(s) matches "
                                             f"{_pinned_text(pinned)}; dp x tp x pp must equal the devices")
    costs = [(layout, trainer_step(shape, work, device, layout)) for layout in layouts]
    fits = [(layout, cost) for layout, cost in costs if cost.memory.total <= device.memory]
    if not fits:
        layout, cost = min(costs, key=lambda lc: lc[1].memory.total)
        raise PlanRefused("trainer memory", f"{cost.memory.total / GIB:.1f} GiB per device needed "
                          f"({cost.memory.describe()}) at the least-memory layout (dp {layout.dp}, tp {layout.tp}, "
                          f"pp {layout.pp}, micro-batch {layout.micro_batch}, recompute {layout.recompute}); "
                          f"{device.name} has {device.memory / GIB:.0f} GiB: add devices, use a larger GPU, "
                          f"or train a LoRA adapter (model.lora_rank)", need=cost.memory.total)
    layout, cost = min(fits, key=lambda lc: lc[1].step_s)
    return layout, cost, len(costs), len(costs) - len(fits)


def _pinned_text(pinned: Pinned) -> str:
    fixed = {k: v for k, v in vars(pinned).items() if v is not None}
    return ", ".join(f"{k}={v}" for k, v in fixed.items()) or "any layout"


def _rows(work: Workload, replicas: int) -> int:
    """Sequences per replica: whole prompt groups (a group stays on one replica)."""
    prompts = math.ceil(work.sequences / work.group_size)
    return math.ceil(prompts / replicas) * work.group_size


def best_generator(shape: ModelShape, work: Workload, device: Device, devices: int,
                   replicas: int | None = None) -> tuple[GenerateCost, int, int]:
    """(cost of one batch, replicas, devices per replica) for a pool of `devices` devices."""
    options = []
    for tp in (t for t in TP_SIZES if t <= min(devices, device.per_node) and shape.num_heads % t == 0):
        counts = (replicas,) if replicas is not None else range(1, devices // tp + 1)
        for count in counts:
            if count * tp > devices or max_rows(shape, work, device, tp) < 1:
                continue
            options.append((generate_batch(shape, work, device, tp, _rows(work, count)), count, tp))
    if not options:
        widest = max(t for t in TP_SIZES if t <= max(1, min(devices, device.per_node)))
        need = generator_memory(shape, work, device, widest, 1)
        raise PlanRefused("generator memory", f"{need.total / GIB:.1f} GiB per device needed ({need.describe()}) "
                          f"for one sequence at tensor parallelism {widest}; {device.name} has "
                          f"{device.memory / GIB:.0f} GiB: use a larger GPU or more devices per replica")
    return min(options, key=lambda o: (o[0].batch_s, o[1] * o[2]))


def best_staleness(*, generate_s: float, train_s: float, sync_s: float, max_staleness: int) -> tuple[int, Simulation]:
    sims = [(k, simulate(generate_s=generate_s, train_s=train_s, sync_s=sync_s, max_staleness=k))
            for k in range(max_staleness + 1)]
    fastest = min(s.step_s for _, s in sims)
    return next((k, s) for k, s in sims if s.step_s <= fastest * STALENESS_SLACK)


def _splits(devices: int, per_node: int) -> list[int]:
    """Trainer device counts to try: all of them on small clusters, whole nodes on large ones."""
    if devices <= 64:
        return list(range(1, devices))
    return [t for t in range(per_node, devices, per_node)]


def plan_gpus(shape: ModelShape, work: Workload, device: Device, devices: int, *, replicas: int | None = None,
              pinned: Pinned = Pinned()) -> Strategy:
    """The fastest strategy on `devices` GPUs; `replicas` pins the generator replica count."""
    if work.kind == "sft":
        layout, cost, considered, refused = best_trainer(shape, work, device, devices, pinned)
        return Strategy(device.name, devices, 0, devices, 0, 0, layout, 0, cost.step_s, cost, None, None,
                        considered, refused)
    if devices < 2:
        raise PlanRefused("devices", f"an RL step needs at least 2 {device.name} devices (a generator and a trainer); "
                                     f"the cluster has {devices}")
    if replicas is not None and replicas >= devices:
        raise PlanRefused("rollout.replicas", f"rollout.replicas={replicas}: the cluster has {devices} GPUs "
                                              f"({device.name}), and each replica needs at least one besides the "
                                              f"trainer's; use at most {devices - 1} or rollout.replicas = \"auto\"")
    best, considered, refused, errors = None, 0, 0, []
    for trainer_devices in _splits(devices, device.per_node):
        pool = devices - trainer_devices
        if replicas is not None and pool < replicas:
            continue
        try:
            layout, cost, n, bad = best_trainer(shape, work, device, trainer_devices, pinned)
            gen, count, gtp = best_generator(shape, work, device, pool, replicas)
        except PlanRefused as e:
            errors.append(e)
            continue
        considered, refused = considered + n, refused + bad
        sync = weight_sync_s(shape, device, gtp)
        k, sim = best_staleness(generate_s=gen.batch_s, train_s=cost.step_s, sync_s=sync,
                                max_staleness=work.max_staleness)
        if best is None or _better(sim.step_s, count * gtp + trainer_devices, best):
            best = Strategy(device.name, devices, count * gtp, trainer_devices, count, gtp, layout, k, sim.step_s,
                            cost, gen, sim)
    if best is None:
        # The closest miss is the telling refusal: the trainer split that needed the least memory.
        memory = [e for e in errors if e.resource == "trainer memory"]
        raise min(memory, key=lambda e: e.need) if memory else errors[-1] if errors else PlanRefused(
            "devices", f"no split of {devices} {device.name} devices fits")
    notes = ()
    if replicas is not None and best.simulation.generator_busy > 0.99 and best.simulation.trainer_busy < 0.9:
        notes = (f"generator-bound with rollout.replicas={replicas} pinned (trainer busy "
                 f"{best.simulation.trainer_busy:.0%}): rollout.replicas = \"auto\" lets the planner add replicas",)
    return replace(best, considered=considered, refused=refused, notes=notes)


def _better(step_s: float, used: int, best: Strategy) -> bool:
    """Faster wins; at an equal step (one side is the bottleneck), fewer idle devices win."""
    if abs(step_s - best.step_s) > 1e-9 * best.step_s:
        return step_s < best.step_s
    return used > best.generator_devices + best.trainer_devices


def plan_cpu(shape: ModelShape, work: Workload, *, trainer_device: Device, generator_device: Device, cores: int,
             trainer_replicas: int, trainer_threads: int, micro_batches: int, generator_threads: int,
             replicas: int | None, pin_staleness: bool = False) -> Strategy:
    """This machine: the engine's processes share `cores` cores; oversubscribed threads time-share.
    The staleness bound is searched up to the workload's (`pin_staleness`: only it, as a run takes it)."""
    layout = TrainLayout(dp=trainer_replicas, micro_batch=math.ceil(work.sequences / micro_batches))
    train = trainer_step(shape, work, trainer_device, layout)
    trainer_cores = trainer_replicas * trainer_threads
    train_memory = trainer_replicas * train.memory.total
    if work.kind == "sft":
        _check_ram(trainer_device, train_memory, Memory(), 0)
        return Strategy(trainer_device.name, cores, 0, trainer_cores, 0, 0, layout, 0, train.step_s, train, None, None, 1)
    best, considered = None, 0
    for count in ((replicas,) if replicas is not None else range(1, max(1, cores // generator_threads) + 1)):
        gen = generate_batch(shape, work, generator_device, 1, _rows(work, count))
        _check_ram(trainer_device, train_memory, gen.memory, count)
        gen_cores = count * generator_threads
        sync = weight_sync_s(shape, trainer_device, 1)
        # A rollout round: sampling plus the env worker's episodes (planner/loop.py).
        round_s = gen.batch_s + work.env_episode_s * work.sequences
        for k in ((work.max_staleness,) if pin_staleness else range(work.max_staleness + 1)):
            considered += 1
            rounds = rounds_per_step(work.sequences // work.group_size, work.zero_variance, k)
            # Threads beyond the cores time-share them; generator and trainer overlap only when async.
            busy = gen_cores + trainer_cores if k else max(gen_cores, trainer_cores)
            slow = max(1.0, busy / cores)
            sim = simulate(generate_s=rounds * round_s * slow, train_s=train.step_s * slow, sync_s=sync,
                           max_staleness=k)
            if best is None or sim.step_s < best.step_s / STALENESS_SLACK:
                notes = ((f"threads {busy} on {cores} cores: x{slow:.2f} time-sharing",) if slow > 1 else ()) + (
                    (f"{rounds:.2f} rollout rounds a step ({work.zero_variance:.0%} of groups without signal)",)
                    if rounds > 1 else ()) + ((f"env work {work.env_episode_s * 1e3:.2f} ms an episode (measured)",)
                                              if work.env_episode_s else ("env work not measured: left out",))
                best = Strategy(trainer_device.name, cores, gen_cores, trainer_cores, count, 1, layout, k, sim.step_s,
                                train, gen, sim, notes=notes)
    return replace(best, considered=considered)


def _check_ram(device: Device, trainer_bytes: float, generator: Memory, replicas: int) -> None:
    need = trainer_bytes + replicas * generator.total
    if need > device.memory:
        raise PlanRefused("memory", f"{need / GIB:.1f} GiB needed (trainer {trainer_bytes / GIB:.2f}, "
                                    f"{replicas} generator replica(s) x {generator.total / GIB:.2f}: "
                                    f"{generator.describe()}); this machine has {device.memory / GIB:.1f} GiB: "
                                    f"use fewer replicas or a smaller model")
