"""The environment contract, in tinker-cookbook's shape, plus episode forking and a task suite.

An `Env` is single-use and async: `initial_observation()` gives the prompt tokens and how to stop,
`step(action)` scores the sampled tokens and says whether the episode goes on (multi-turn) with a
next observation. A later observation must extend the previous context plus the action (the
runtime trains on one token sequence per episode; env-inserted tokens carry no loss). An
`EnvGroupBuilder` makes the envs of one group, the unit of advantage centring (GRPO). An
`RLDataset` is a sequence of batches of builders, a pure function of the batch index, so that a
group can be rebuilt from its id when it is replayed. Every built-in env implements `snapshot()` /
`restore()` (an `EnvSnapshot`: typed and versioned, so a snapshot restored into another env type or
by another lockstep version is refused); the runtime uses them to retry a failed step from the
state before it, and to fork an episode into branches (`rollout.fork`). A restored env given the
same actions yields the same observations and rewards.

An `EnvSuite` is what a config's `[env]` section resolves to: training batches, a held-out set
and supervised examples for warm-up stages. Built-in suites live next to this file; a user's own
is named `module:function` in the config (see `lockstep.envs.registry`).
"""

from __future__ import annotations

import functools
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


SNAPSHOT_FORMAT = 1
"""Bumped when a built-in env's snapshot state changes shape."""


@functools.cache  # reading package metadata parses a file: 0.85 ms, 87% of an arithmetic episode's env time
def _lockstep_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lockstep")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class EnvSnapshot:
    """An episode's state, restorable into another env of the same type (a fork's branch)."""

    env_type: str
    """The env's class, "module.QualName"."""
    lockstep: str
    format: int
    state: Any

    @classmethod
    def of(cls, env, state: Any) -> "EnvSnapshot":
        return cls(_type_name(env), _lockstep_version(), SNAPSHOT_FORMAT, state)

    def state_for(self, env) -> Any:
        """The state, after checking it belongs to `env`'s type and this lockstep; EnvError otherwise."""
        if self.env_type != _type_name(env):
            raise EnvError(f"{_type_name(env)}.restore: this snapshot is of a {self.env_type} env; restore it into "
                           f"an env of that type")
        if (self.lockstep, self.format) != (_lockstep_version(), SNAPSHOT_FORMAT):
            raise EnvError(f"{_type_name(env)}.restore: the snapshot was taken by lockstep {self.lockstep} (format "
                           f"{self.format}); this is lockstep {_lockstep_version()} (format {SNAPSHOT_FORMAT}): "
                           f"restart the episode instead")
        return self.state


def _type_name(env) -> str:
    return f"{type(env).__module__}.{type(env).__qualname__}"


def restore_state(env, snapshot) -> Any:
    """`snapshot.state_for(env)`, with a clear EnvError for anything that is no EnvSnapshot."""
    if not isinstance(snapshot, EnvSnapshot):
        raise EnvError(f"{_type_name(env)}.restore: expected an EnvSnapshot, got {type(snapshot).__name__}")
    return snapshot.state_for(env)


@runtime_checkable
class ForkableEnv(Env, Protocol):
    """An env whose episode can be copied mid-way (to branch continuations, or to retry a step)."""

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any) -> None:
        """Put this env (a fresh one of the same type, or the one snapshotted) in the snapshot's state."""
        ...


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
