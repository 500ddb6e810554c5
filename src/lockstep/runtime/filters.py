"""In-loop data cleaning and advantage computation (pure functions over rollout groups)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lockstep.advantages import get_estimator
from lockstep.runtime.types import RolloutGroup


@dataclass(frozen=True)
class FilterReport:
    kept: tuple[RolloutGroup, ...]
    zero_variance: int
    """Groups dropped because every sample got the same reward (no learning signal)."""
    truncated: int
    """Samples that hit max_tokens without stopping."""
    repetitive: int
    """Samples flagged for degenerate repetition."""
    stale: int
    """Groups dropped by the staleness gate."""
    no_signal: tuple[RolloutGroup, ...] = ()
    """The zero-variance groups themselves, used to complete a batch when refilling runs out."""


def is_repetitive(tokens: Sequence[int], *, ngram: int = 3, max_repeats: int = 4) -> bool:
    """True when some n-gram occurs more than `max_repeats` times (a degenerate loop)."""
    if len(tokens) < ngram * (max_repeats + 1):
        return False
    counts: dict[tuple, int] = {}
    for i in range(len(tokens) - ngram + 1):
        key = tuple(tokens[i : i + ngram])
        counts[key] = counts.get(key, 0) + 1
        if counts[key] > max_repeats:
            return True
    return False


def too_stale(group: RolloutGroup, trainer_version: int, max_staleness: int) -> bool:
    """The staleness bound: trained at `trainer_version`, may this group still be used?"""
    return trainer_version - group.version > max_staleness


def clean(groups: Sequence[RolloutGroup], *, trainer_version: int, max_staleness: int,
          truncated_penalty: float | None = None) -> FilterReport:
    """Staleness gate, truncation handling and zero-variance dropping, with counts.

    Truncated samples keep their reward unless `truncated_penalty` is given, in which case their
    reward becomes that value; repetitive samples are flagged (counted), not removed.
    """
    kept, flat, truncated, repetitive, stale = [], [], 0, 0, 0
    for g in groups:
        if too_stale(g, trainer_version, max_staleness):
            stale += 1
            continue
        samples = []
        for s in g.samples:
            if s.stop_reason == "length":
                truncated += 1
                if truncated_penalty is not None:
                    s = type(s)(s.tokens, s.logprobs, s.version, s.stop_reason, truncated_penalty, s.metrics)
            repetitive += is_repetitive(s.tokens)
            samples.append(s)
        rewards = np.array([s.reward for s in samples])
        group = RolloutGroup(g.group_id, g.prompt, g.problem, tuple(samples))
        (flat if np.all(rewards == rewards[0]) else kept).append(group)
    return FilterReport(tuple(kept), len(flat), truncated, repetitive, stale, tuple(flat))


def to_datums(groups: Sequence[RolloutGroup], *, estimator: str = "grpo"):
    """Policy-gradient datums: prompt positions carry no advantage; sampled tokens carry the
    sample's group-centred advantage and the sampler's exact logprobs.

    Returns (datums, sampled_from): where each datum's sampled tokens start, for the mismatch panel.
    """
    from lockstep.engine.types import Datum

    advantage = get_estimator(estimator)
    data, sampled_from = [], []
    for g in groups:
        adv = advantage(np.array([s.reward for s in g.samples], dtype=np.float64))
        n = len(g.prompt)
        for s, a in zip(g.samples, adv):
            if not s.tokens:
                continue
            full = list(g.prompt) + list(s.tokens)
            inputs = {
                "target_tokens": np.asarray(full[1:], np.int64),
                "logprobs": np.asarray([0.0] * (n - 1) + list(s.logprobs), np.float32),
                "advantages": np.asarray([0.0] * (n - 1) + [a] * len(s.tokens), np.float32),
            }
            data.append(Datum(tuple(full[:-1]), inputs))
            sampled_from.append(n - 1)
    return data, sampled_from
