"""The runtime's contract: what moves between generator, env pool, buffer, ledger and trainer.

Plain frozen dataclasses of Python scalars and tuples, so they pickle cheaply through Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_REFILL_BATCHES = 4
"""Dynamic sampling draws at most this many rollout batches per step before completing the batch
with zero-variance groups (zero advantage, so no gradient) rather than waiting forever (the
planner's loop model counts on it too)."""


@dataclass(frozen=True)
class Sample:
    """One episode of one env: every token after the prompt, sampled or inserted by the env."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The sampler's logprob of each sampled token (the behaviour policy, exact); 0.0 where the
    env inserted the token."""
    version: int
    """Oldest weights version that produced any token of this sample."""
    stop_reason: str
    """Of the last turn: "stop" or "length" (truncated)."""
    reward: float = 0.0
    """Sum of the episode's step rewards."""
    metrics: dict = field(default_factory=dict)
    """The final step's env metrics (e.g. "correct")."""
    sampled: tuple[bool, ...] = ()
    """Per token: True where the policy sampled it; empty means every token was sampled."""
    turns: int = 1
    family: int = -1
    """With forking (rollout.fork): the index, within its group, of the episode this one branched
    from (its branches share it); -1 for an episode that was not forked."""
    fork_at: int = 0
    """With forking: tokens before this index are the prefix shared with the family's other
    branches (their advantage comes from the family's mean reward); 0: no shared prefix."""
    owns_prefix: bool = True
    """Whether this branch trains the shared prefix (exactly one branch of a family does)."""

    def is_sampled(self, i: int) -> bool:
        return not self.sampled or self.sampled[i]

    @property
    def correct(self) -> bool:
        return bool(self.metrics["correct"]) if "correct" in self.metrics else self.reward > 0


@dataclass(frozen=True)
class RolloutGroup:
    """All samples of one prompt: the unit of advantage centring and of exactly-once accounting."""

    group_id: str
    """Ledger key: "<stage>.<batch>.<index>" for training groups."""
    prompt: tuple[int, ...]
    samples: tuple[Sample, ...] = ()
    failed: int = 0
    """Samples whose env call raised or timed out after every retry; a group with any failure is
    not trained (a made-up reward would bias it)."""
    generated_at: float = 0.0
    """Wall time the group's last sampling turn finished."""
    rewarded_at: float = 0.0
    """Wall time its last reward was computed."""

    @property
    def version(self) -> int:
        return min(s.version for s in self.samples)


@dataclass(frozen=True)
class RolloutRequest:
    """A batch of groups for an env worker to roll out through the generator."""

    group_ids: tuple[str, ...]
    builders: tuple
    """EnvGroupBuilders, one per group id (picklable)."""
    group_size: int
    temperature: float
    seed: int
    """Sampling seeds derive from (seed, group id, turn, request index within the group): a
    group's tokens do not depend on its batch, its replica or whether it is a replay."""
    fork_turn: int = 0
    """Fork each episode still running after this many turns into `fork_branches` (0: never)."""
    fork_branches: int = 1
    routes: tuple[int, ...] = ()
    """The generator replica of each group (the router's choice: all of a group's turns go to one
    replica, which shares its prompt's prefill); empty: replica 0."""


class ActorRestarted(RuntimeError):
    """Raised by an actor that Ray restarted, on a call that needs the state it lost (weights): the
    controller treats it like the crash itself, so a restart between two calls is never silent."""
