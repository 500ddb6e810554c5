"""Typed, frozen, torch-free run specs (`lockstep run`, and later the job service).

Every field has a default, so an empty TOML is the embedded default run. Each spec validates
itself in __post_init__ and raises ConfigError with the key path and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """An invalid config: the message names the key path and what was expected."""


def _require(cond: bool, path: str, expected: str, got) -> None:
    if not cond:
        raise ConfigError(f"{path}: expected {expected}, got {got!r}")


@dataclass(frozen=True)
class ModelSpec:
    path: str = "builtin"
    """A local Hugging Face model directory, or "builtin" for the built-in tiny model."""
    lora_rank: int = 0
    """0 trains every weight; > 0 trains a LoRA adapter of this rank."""
    lora_alpha: float = 32.0

    def __post_init__(self) -> None:
        _require(isinstance(self.lora_rank, int) and self.lora_rank >= 0, "model.lora_rank", "an integer >= 0", self.lora_rank)


@dataclass(frozen=True)
class EnvSpec:
    name: str = "arithmetic"
    """"arithmetic" (procedural), "math" (jsonl/parquet rows) or "reasoning_gym" (a task by name)."""
    digits: int = 3
    """arithmetic: operands have up to this many digits."""
    max_tokens: int = 6
    """Most tokens sampled per answer."""
    num_heldout: int = 200
    """Held-out problems for evaluation."""

    def __post_init__(self) -> None:
        _require(self.name in ("arithmetic",), "env.name", "one of ['arithmetic'] (math and reasoning_gym are not built yet)", self.name)
        _require(isinstance(self.digits, int) and 1 <= self.digits <= 9, "env.digits", "an integer in [1, 9]", self.digits)
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "env.max_tokens", "an integer >= 1", self.max_tokens)
        _require(isinstance(self.num_heldout, int) and self.num_heldout >= 1, "env.num_heldout", "an integer >= 1", self.num_heldout)


@dataclass(frozen=True)
class StageSpec:
    kind: Literal["sft", "rl"] = "rl"
    """"sft": cross-entropy on correct examples; "rl": sample, reward, advantage, policy loss."""
    steps: int = 100
    """Optimizer steps in this stage (an RL stage may stop earlier, see max_seconds/target_accuracy)."""
    learning_rate: float = 1e-3
    batch_size: int = 64
    """sft: examples per step."""
    prompts_per_step: int = 16
    """rl: prompt groups per optimizer step."""
    group_size: int = 8
    """rl: samples per prompt (the advantage group)."""
    loss: str = "importance_sampling"
    advantage: str = "grpo"
    temperature: float = 1.0
    max_staleness: int = 1
    """rl: a sample may be used while trainer_version - sample_version <= this; 0 is synchronous."""
    max_seconds: float = 0.0
    """Stop the stage after this much wall time (0: no limit)."""
    target_accuracy: float = 0.0
    """Stop the stage once held-out accuracy reaches this (0: never)."""
    eval_every: int = 50
    """Evaluate held-out greedy accuracy every this many steps (and at the end)."""

    def __post_init__(self) -> None:
        p = f"stages[{self.kind}]"
        _require(self.kind in ("sft", "rl"), f"{p}.kind", "'sft' or 'rl'", self.kind)
        for name in ("steps", "batch_size", "prompts_per_step", "eval_every"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 1, f"{p}.{name}", "an integer >= 1", v)
        _require(isinstance(self.group_size, int) and self.group_size >= 2, f"{p}.group_size", "an integer >= 2", self.group_size)
        _require(isinstance(self.max_staleness, int) and self.max_staleness >= 0, f"{p}.max_staleness", "an integer >= 0", self.max_staleness)
        _require(isinstance(self.learning_rate, (int, float)) and 0 < self.learning_rate < 1, f"{p}.learning_rate", "a number in (0, 1)", self.learning_rate)
        _require(isinstance(self.temperature, (int, float)) and 0 < self.temperature <= 2, f"{p}.temperature", "a number in (0, 2]", self.temperature)
        _require(self.max_seconds >= 0 and 0 <= self.target_accuracy <= 1, f"{p}.max_seconds/target_accuracy", ">= 0 and accuracy in [0, 1]", (self.max_seconds, self.target_accuracy))
        _require(self.advantage in ("grpo", "rloo"), f"{p}.advantage", "'grpo' or 'rloo'", self.advantage)


def default_stages() -> tuple[StageSpec, ...]:
    return (
        # Warm-up: stop as soon as held-out accuracy passes 30%, leaving the rest to RL.
        StageSpec(kind="sft", steps=600, learning_rate=3e-3, batch_size=128, eval_every=25, target_accuracy=0.3),
        # GRPO until held-out accuracy reaches 85% (the final eval then repeats that exact greedy
        # result) or 400 s pass. Staleness 2 rather than 1: with half the groups dropped for zero
        # variance, leftovers from the older in-flight batch are otherwise discarded as stale.
        StageSpec(kind="rl", steps=3000, learning_rate=2e-4, prompts_per_step=16, group_size=8, max_staleness=2,
                  max_seconds=400.0, target_accuracy=0.85, eval_every=25),
    )


@dataclass(frozen=True)
class RuntimeSpec:
    ray_address: str = ""
    """Empty: start a local Ray instance; otherwise join this cluster address."""
    generator_threads: int = 1
    trainer_threads: int = 1
    env_workers: int = 1
    call_timeout_s: float = 300.0
    """Deadline for any cross-component call; a hang becomes an error."""
    checkpoint_every: int = 200
    """Save a checkpoint every this many optimizer steps (0: only at the end)."""

    def __post_init__(self) -> None:
        for name in ("generator_threads", "trainer_threads", "env_workers"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 1, f"runtime.{name}", "an integer >= 1", v)
        _require(self.call_timeout_s > 0, "runtime.call_timeout_s", "a number > 0", self.call_timeout_s)
        _require(isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0, "runtime.checkpoint_every", "an integer >= 0", self.checkpoint_every)


@dataclass(frozen=True)
class RunSpec:
    model: ModelSpec = field(default_factory=ModelSpec)
    env: EnvSpec = field(default_factory=EnvSpec)
    stages: tuple[StageSpec, ...] = field(default_factory=default_stages)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    seed: int = 0

    def __post_init__(self) -> None:
        _require(len(self.stages) >= 1, "stages", "at least one stage", self.stages)
