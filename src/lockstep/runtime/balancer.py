"""The thread plans an asynchronous RL stage chooses from, ordered as a ladder.

On a CPU box the cores are what the generator and the trainer compete for, and which split is
fastest depends on the machine: on a 2-core AVX2 EPYC, trainer 2 + generator 1 threads ran 25
steps in 13.6 s against 17.7 s for 1 + 1; on a 2-vCPU AVX-512 Xeon (two hyperthreads of one
core) the same 2 + 1 took 0.220 s per step against 0.161 s for 1 + 1, because the third thread
oversubscribes the core. So no split is guessed: the allocator (`allocator.py`) measures them.
It walks this ladder one rung at a time, from the even split towards the busier stage.
"""

from __future__ import annotations

Plan = tuple[int, int]
"""(trainer threads, generator threads)."""


def candidate_plans(cpus: int) -> list[Plan]:
    """An even split, then the trainer or the generator given every core (the other a quarter)."""
    minor = max(1, cpus // 4)
    plans = [(max(1, cpus // 2), max(1, cpus - cpus // 2)), (cpus, minor), (minor, cpus)]
    return list(dict.fromkeys(plans))


def ladder(cpus: int) -> list[Plan]:
    """The candidate plans from the generator-heaviest to the trainer-heaviest, so that a move
    towards the trainer is one rung up and towards the generator one rung down."""
    return sorted(candidate_plans(cpus), key=lambda p: p[0] / (p[0] + p[1]))
