"""The RL loop as the runtime runs it, on top of the engine's costs: how many rollout rounds a step
takes, and what a round costs beyond sampling.

Rounds. The runtime trains once `prompts_per_step` groups with reward signal are buffered
(runtime/controller.py, dynamic sampling): each rollout batch of `prompts_per_step` groups yields a
Binomial(prompts, 1 - zero_variance) number of them, and it draws up to MAX_REFILL_BATCHES batches.
In a synchronous loop the groups left over when a step is full were sampled under weights that the
step then replaces, so they go stale (and are drawn again later): the expected rounds per step
are 1 + sum over r < MAX_REFILL_BATCHES of P(Binomial(r * prompts, q) < prompts). In an
asynchronous loop leftovers within the staleness bound are kept, so a step costs 1 / q rounds on
average (at most MAX_REFILL_BATCHES).

A round is one rollout: the env worker starts every episode, asks the generator for the batch's
tokens, steps every env and computes rewards; its env work is `env_episode_s` per episode.
"""

from __future__ import annotations

import math

from lockstep.runtime.types import MAX_REFILL_BATCHES


def rounds_per_step(prompts: int, zero_variance: float, max_staleness: int) -> float:
    """Expected rollout batches the runtime draws per optimizer step."""
    q = 1.0 - zero_variance
    if zero_variance <= 0.0:
        return 1.0
    if max_staleness > 0:
        return min(float(MAX_REFILL_BATCHES), 1.0 / q)
    return 1.0 + sum(_below(r * prompts, q, prompts) for r in range(1, MAX_REFILL_BATCHES))


def _below(n: int, q: float, k: int) -> float:
    """P(Binomial(n, q) < k)."""
    return sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(min(k, n + 1)))
