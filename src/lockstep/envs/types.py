"""The environment contract, in tinker-cookbook's shape, plus episode forking.

An `Env` is single-use and async: `initial_observation()` gives the prompt tokens and how to stop,
`step(action)` scores the sampled tokens and says whether the episode goes on (multi-turn) with a
next observation. An `EnvGroupBuilder` makes the envs of one group, the unit of advantage
centring (GRPO). An `RLDataset` is a sequence of batches of builders. Envs that can fork an
episode implement `snapshot()` / `restore()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class Observation:
    """What the policy sees next."""

    tokens: tuple[int, ...]
    """The full context to condition on (prompt and, in later turns, history)."""
    stop: tuple[int | str, ...] | None = None
    """Stop token ids or strings for this turn (None: EOS only)."""
    max_tokens: int = 16
    """Most new tokens this turn."""


@dataclass(frozen=True)
class StepResult:
    """The env's answer to one action."""

    reward: float
    episode_done: bool
    next_observation: Observation | None = None
    """Required when episode_done is False."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-step env metrics, e.g. {"correct": 1.0}."""


@runtime_checkable
class Env(Protocol):
    async def initial_observation(self) -> Observation: ...

    async def step(self, action: Sequence[int]) -> StepResult: ...


@runtime_checkable
class ForkableEnv(Env, Protocol):
    """An env whose episode can be copied mid-way (e.g. to branch several continuations)."""

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any) -> None: ...


class EnvGroupBuilder(Protocol):
    """Makes the envs of one group; must be picklable (it crosses process boundaries)."""

    group_id: str
    """Stable id of this group (the exactly-once ledger keys on it)."""

    def make_envs(self, group_size: int) -> Sequence[Env]: ...


class RLDataset(Protocol):
    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]: ...

    def __len__(self) -> int: ...
