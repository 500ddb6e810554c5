"""An event simulation of the asynchronous RL step: the generator pool producing rollout batches,
the trainer consuming them, new weights reaching the generators, and the staleness bound.

    generator pool:  [gen 0][gen 1][gen 2]......[gen 3] ...     a batch at a time, all replicas on it
    trainer:                [train 0][train 1][train 2] ...     a batch at a time, in order
    weights:                         ^v1      ^v2               train end + sync: version visible

Batch i may start only with a policy at most `max_staleness` versions old: generation of batch i
waits for version i - max_staleness (the weights after step i - max_staleness - 1) to be visible,
so max_staleness + 1 batches are in flight at most; 0 is the synchronous loop (generate, train,
sync, repeat). Times are deterministic (every batch costs the predicted time), so the steady state
is reached after a few steps; the step time is measured over the last `steps - warmup` of them.
"""

from __future__ import annotations

from lockstep.planner.types import Simulation


def simulate(*, generate_s: float, train_s: float, sync_s: float, max_staleness: int, steps: int = 48,
             warmup: int = 16) -> Simulation:
    assert steps > warmup + 1 and min(generate_s, train_s, sync_s) >= 0 and max_staleness >= 0
    visible: list[float] = []  # visible[j]: when the weights after step j reach the generators
    gen_end = train_end = 0.0
    gen_busy = train_busy = 0.0
    ends, staleness = [], []
    for i in range(steps):
        need = i - max_staleness - 1  # the step whose weights batch i must be generated with
        start = max(gen_end, visible[need] if need >= 0 else 0.0)
        version = sum(1 for t in visible if t <= start)  # the newest weights at the start
        gen_end = start + generate_s
        train_start = max(gen_end, train_end)
        train_end = train_start + train_s
        visible.append(train_end + sync_s)
        if i >= warmup:
            gen_busy += generate_s
            train_busy += train_s
            staleness.append(i - version)
        ends.append(train_end)
    span = ends[-1] - ends[warmup - 1]
    counted = steps - warmup
    step = span / counted
    return Simulation(step_s=step, generator_busy=min(1.0, gen_busy / span) if span else 1.0,
                      trainer_busy=min(1.0, train_busy / span) if span else 1.0,
                      mean_staleness=sum(staleness) / len(staleness), sync_s=sync_s)
