"""The environment contract, in tinker-cookbook's shape, plus episode forking and a task suite.

An `Env` is single-use and async: `initial_observation()` gives the prompt tokens and how to stop,
`step(action)` scores the sampled tokens and says whether the episode goes on (multi-turn) with a
next observation. A later observation must extend the previous context plus the action (the
runtime trains on one token sequence per episode; env-inserted tokens carry no loss). An
`EnvGroupBuilder` makes the envs of one group, the unit of advantage centring (GRPO). An
`RLDataset` is a sequence of batches of builders, a pure function of the batch index, so that a
group can be rebuilt from its id when it is replayed. Envs that can fork an episode implement
`snapshot()` / `restore()`; the runtime uses them to retry a failed step from the state before it.

An `EnvSuite` is what a config's `[env]` section resolves to: training batches, a held-out set
and supervised examples for warm-up stages. Built-in suites live next to this file; a user's own
is named `module:function` in the config (see `lockstep.envs.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable


class EnvError(ValueError):
    """A user error in env configuration or data: the message says what to fix."""


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
    """Required when episode_done is False; its tokens must start with the previous context and
    the action just taken."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-step env metrics. `correct` (1.0 / 0.0) on the final step is what held-out accuracy
    and pass@k count; without it, a sample counts as correct when its total reward is > 0."""


@runtime_checkable
class Env(Protocol):
    async def initial_observation(self) -> Observation: ...

    async def step(self, action: Sequence[int]) -> StepResult: ...


@runtime_checkable
class ForkableEnv(Env, Protocol):
    """An env whose episode can be copied mid-way (to branch continuations, or to retry a step)."""

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any) -> None: ...


class EnvGroupBuilder(Protocol):
    """Makes the envs of one group; must be picklable (it crosses process boundaries)."""

    group_id: str
    """Stable id of this group (the exactly-once ledger keys on it)."""

    def make_envs(self, group_size: int, tokenizer) -> Sequence[Env]:
        """`group_size` fresh envs for this group's problem; `tokenizer` is the model's (HF)."""
        ...


class RLDataset(Protocol):
    """Batches of group builders; `get_batch(i)` is a pure function of `i` (replay rebuilds it)."""

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]: ...

    def __len__(self) -> int:
        """Batches per epoch; `get_batch` wraps around (a new shuffle each epoch)."""
        ...


@dataclass(frozen=True)
class SFTExample:
    """One supervised example: the loss is on `completion` only."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    """Trained tokens, ending with EOS."""


class SupervisedDataset(Protocol):
    def get_batch(self, index: int) -> Sequence[SFTExample]: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class DataReport:
    """What loading a data file skipped, so a run can report it."""

    rows: int
    """Rows read."""
    skipped: int
    """Rows skipped (missing or empty fields); each was warned about by row number."""


class EnvSuite(Protocol):
    """What `[env]` resolves to. Every method is deterministic given the suite's seed."""

    name: str

    def train(self, batch_size: int) -> RLDataset:
        """Training batches of `batch_size` groups; group ids are unique across batches."""
        ...

    def heldout(self) -> Sequence[EnvGroupBuilder]:
        """The fixed evaluation set (never in a training batch)."""
        ...

    def sft(self, batch_size: int, path: str = "") -> SupervisedDataset:
        """Warm-up examples: from `path` (jsonl/parquet rows of prompt and completion) when given,
        otherwise the suite's own solved examples."""
        ...

    @property
    def data_reports(self) -> Mapping[str, DataReport]:
        """Per data file read so far: rows read and rows skipped."""
        ...
