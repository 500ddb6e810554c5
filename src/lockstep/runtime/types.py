"""The runtime's contract: what moves between generator, env pool, buffer and trainer.

Plain frozen dataclasses of Python scalars and tuples, so they pickle cheaply through Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    """One completion of a prompt."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The sampler's logprob of each token (the behaviour policy, exact)."""
    version: int
    """Oldest weights version that produced any token of this sample."""
    stop_reason: str
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutGroup:
    """All samples of one prompt: the unit of advantage centring and of exactly-once accounting."""

    group_id: str
    prompt: tuple[int, ...]
    problem: object
    """What the env needs to score (picklable), e.g. an arithmetic Problem."""
    samples: tuple[Sample, ...] = ()

    @property
    def version(self) -> int:
        return min(s.version for s in self.samples)
