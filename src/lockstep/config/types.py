"""Typed, frozen, torch-free run specs (`lockstep run`, and later the job service).

Every field has a default, so an empty TOML is the embedded default run. Each spec validates
itself in __post_init__ and raises ConfigError with the key path and what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Literal

from lockstep.advantages import ADVANTAGE_ESTIMATORS
from lockstep.sandbox.types import Limits


class ConfigError(ValueError):
    """An invalid config: the message names the key path and what was expected."""


def _require(cond: bool, path: str, expected: str, got) -> None:
    if not cond:
        raise ConfigError(f"{path}: expected {expected}, got {got!r}")


@dataclass(frozen=True)
class Range:
    """The interval a hyperparameter must lie in: closed unless an end is marked open."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def holds(self, value) -> bool:
        """A finite real number (not a bool) inside the interval."""
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"


def _num(x: float) -> str:
    return f"{x:g}".replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")


def check_range(path: str, value, bounds: Range) -> None:
    """ConfigError naming `path` and the range unless `value` is a finite number in `bounds`."""
    if not bounds.holds(value):
        raise ConfigError(f"{path} must be a number in {bounds}, got {value!r}")


DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
"""The engine's devices and dtypes (engine/device.py), named here torch-free."""


LORA_ALPHA = Range(0.0, 1e4, low_open=True)
"""A LoRA adapter's output is scaled by alpha / rank: recipes use alpha of 1 to 4 x rank (rank <= 1024
here); a huge alpha multiplies the first step's change to the weights by as much."""


@dataclass(frozen=True)
class ModelSpec:
    path: str = "builtin"
    """A local Hugging Face model directory, or "builtin" for the built-in tiny model."""
    lora_rank: int = 0
    """0 trains every weight; > 0 trains a LoRA adapter of this rank."""
    lora_alpha: float = 32.0
    train_experts: tuple[int, ...] | None = None
    """For a mixture-of-experts model: the experts that train (e.g. [0, 3]); the others' weights
    stay bitwise unchanged. None trains every expert. Needs lora_rank 0."""
    device: str = "cpu"
    """"cpu" (the fused C++ kernels) or "cuda" (the Triton kernels, engine/triton_kernels.py): where
    the trainer and the generator compute. A run places them on GPUs when this is "cuda"."""
    dtype: str = "float32"
    """"float32", or "bfloat16" (bf16 weights and activations, fp32 accumulation and logprobs;
    needs device "cuda")."""

    def __post_init__(self) -> None:
        _require(self.device in DEVICES, "model.device", " or ".join(map(repr, DEVICES)), self.device)
        _require(self.dtype in DTYPES, "model.dtype", " or ".join(map(repr, DTYPES)), self.dtype)
        _require(self.dtype == "float32" or self.device == "cuda", "model.dtype",
                 "'float32' on device 'cpu' (the CPU kernels are float32 only; bfloat16 needs model.device = 'cuda')",
                 self.dtype)
        _require(isinstance(self.lora_rank, int) and self.lora_rank >= 0, "model.lora_rank", "an integer >= 0", self.lora_rank)
        check_range("model.lora_alpha", self.lora_alpha, LORA_ALPHA)
        if self.train_experts is not None:
            ok = isinstance(self.train_experts, (list, tuple)) and all(
                isinstance(e, int) and not isinstance(e, bool) and 0 <= e < 2**16 for e in self.train_experts)
            _require(ok and len(set(self.train_experts)) == len(self.train_experts), "model.train_experts",
                     "a list of distinct expert indices (integers >= 0)", self.train_experts)
            _require(self.lora_rank == 0, "model.train_experts", "lora_rank 0 (experts train fully)", self.lora_rank)
            object.__setattr__(self, "train_experts", tuple(sorted(self.train_experts)))


BUILTIN_ENVS = ("arithmetic", "long_addition", "math", "reasoning_gym", "code", "python_tool")
"""The built-in env suites, each `lockstep.envs.<name>:make_suite`; the one list of their names."""

# Optimizer ranges: wide enough for every recipe we know of, narrow enough that a value outside
# cannot be a choice (1e30 came from a unit slip and left the model NaN for good). Adam moves each
# weight by about learning_rate per step, so above 1 a step outweighs the weights themselves (LM
# recipes stop near 1e-1). eps: a weight whose gradient squares to float32's zero (|g| < ~4e-23)
# moves by lr * |g| / eps, which stays under lr from 1e-20 up; eps = 0 makes it 0/0 = NaN. The
# cross-check below (learning_rate x weight_decay <= 1) covers decay: each step scales every weight
# by 1 - lr * weight_decay, whose sign flips past 1. A clip norm over 1e6 clips nothing.
ADAM_RANGES: dict[str, Range] = {
    "learning_rate": Range(0.0, 1.0),
    "beta1": Range(0.0, 1.0, high_open=True),
    "beta2": Range(0.0, 1.0, high_open=True),
    "eps": Range(1e-20, 1.0),
    "weight_decay": Range(0.0, 10.0),
    "grad_clip_norm": Range(0.0, 1e6),
}
"""AdamW's per-step hyperparameters (the Tinker AdamParams fields) and the range of each."""
MAX_DECAY_PER_STEP = 1.0
"""The most learning_rate x weight_decay may be (the fraction of each weight a step decays away)."""


def check_decay(learning_rate: float, weight_decay: float) -> None:
    """learning_rate x weight_decay at most MAX_DECAY_PER_STEP (both already in range)."""
    if learning_rate * weight_decay > MAX_DECAY_PER_STEP:
        raise ConfigError(f"learning_rate x weight_decay must be at most {_num(MAX_DECAY_PER_STEP)} (each step "
                          f"scales every weight by 1 - their product), got {learning_rate!r} x {weight_decay!r}")


def check_adam(values: dict, path: str = "adam_params") -> None:
    """Every AdamParams field given in `values` in its range, and check_decay."""
    for name, value in values.items():
        check_range(f"{path}.{name}", value, ADAM_RANGES[name])
    try:
        check_decay(values.get("learning_rate", 0.0), values.get("weight_decay", 0.0))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


LOSSES: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
    "gspo": ("clip_low_threshold", "clip_high_threshold"),
}
"""The built-in losses and the config keys each takes: the one torch-free list of their names
(the engine's registry in `lockstep.losses` registers exactly these, and checks it at import)."""

UNSUPPORTED_LOSSES: dict[str, str] = {
    "stable_reinforce": "its math is unpublished, so it cannot be reproduced faithfully",
}
"""Names a user may reasonably ask for that are deliberately not implemented, with the reason."""

LOSS_CORRECTION_KEYS = ("tis_cap", "mis_low", "mis_high")
"""Config keys every loss accepts: truncated / masked importance-sampling corrections."""

# Ratio bounds: the on-policy ratio is 1, so a floor lies in [0, 1] and a ceiling from 1 up (the
# GSPO paper's band is 1 -/+ 3e-4; CISPO and clip-higher recipes use ceilings of 1.28 to ~5). A
# ceiling past 1e6 never binds (a trainer/sampler gap of e^14): leave the key out instead. beta
# weighs DRO's squared log-ratio penalty: KL-style coefficients run 1e-3 to ~1; 1e3 already makes
# the penalty all of the objective.
LOSS_CONFIG_RANGES: dict[str, Range] = {
    "clip_low_threshold": Range(0.0, 1.0),
    "clip_high_threshold": Range(1.0, 1e6),
    "beta": Range(0.0, 1e3),
    "tis_cap": Range(0.0, 1e6, low_open=True),
    "mis_low": Range(0.0, 1.0),
    "mis_high": Range(1.0, 1e6),
}
"""The range of every built-in loss config key (a custom loss checks its own)."""

LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
}
"""The loss_fn_inputs keys every datum of each built-in loss must carry (Tinker's table). The
others have a documented default: cross_entropy's weights are ones, per-token clip thresholds
fall back to the config's. gspo's mask has none: all ones would put the prompt (logprobs padded
with 0) into the sequence ratio. A TIS/MIS correction in the config needs logprobs too."""

LOSS_INPUT_MEANINGS: dict[str, str] = {
    "target_tokens": "int64, the token each position predicts",
    "logprobs": "float32, the sampler's logprob of each target token",
    "advantages": "float32, each target token's advantage (0 on the prompt)",
    "sequence_ratio_mask": "float32, 1 on the sampled tokens that form the sequence ratio, 0 elsewhere",
}

WHOLE_REQUEST_INPUTS = ("clip_low_threshold", "clip_high_threshold")
"""Per-token inputs a request gives on every datum or on none: a datum without one would be
padded with 0 (a floor or ceiling of 0) rather than get the config's threshold."""


def loss_inputs(needs: tuple[str, ...], config: dict) -> tuple[str, ...]:
    """`needs` (a loss's inputs), plus logprobs when the config asks for a TIS/MIS correction."""
    if "logprobs" in needs or not any(k in config for k in LOSS_CORRECTION_KEYS):
        return needs
    return (*needs, "logprobs")


def missing_loss_input(name: str, needs: tuple[str, ...], config: dict, data_keys) -> str | None:
    """What the first datum lacking an input of loss `name` (with `config`) lacks, as a message
    naming the datum and the key; None when every datum has them. data_keys: each datum's keys."""
    required = loss_inputs(needs, config)
    data_keys = [set(keys) for keys in data_keys]
    for i, keys in enumerate(data_keys):
        for key in required:
            if key not in keys:
                what = f"loss {name!r}" + ("" if key in needs else " with a tis_cap/mis_low/mis_high correction")
                meaning = LOSS_INPUT_MEANINGS.get(key, "one value per model_input token")
                return f"datum {i}: {what} needs loss_fn_inputs[{key!r}] ({meaning}); it was not sent"
    for key in WHOLE_REQUEST_INPUTS:
        given = [i for i, keys in enumerate(data_keys) if key in keys]
        if given and len(given) != len(data_keys):
            i = next(i for i, keys in enumerate(data_keys) if key not in keys)
            return (f"datum {i}: loss_fn_inputs[{key!r}] is missing but datum {given[0]} has it; send it on every "
                    f"datum or none (the config's threshold then applies)")
    return None


assert set(LOSS_CONFIG_RANGES) == {k for keys in LOSSES.values() for k in keys} | set(LOSS_CORRECTION_KEYS)
assert set(LOSS_INPUTS) == set(LOSSES)


def check_loss(name: str, config: dict) -> None:
    """A built-in loss and config keys it takes, each a number in its range; ConfigError otherwise."""
    supported = ", ".join(LOSSES)
    if name in UNSUPPORTED_LOSSES:
        raise ConfigError(f"loss {name!r} is not supported: {UNSUPPORTED_LOSSES[name]}; supported: {supported}")
    if name not in LOSSES:
        raise ConfigError(f"unknown loss {name!r}; supported: {supported}")
    allowed = set(LOSSES[name]) | set(LOSS_CORRECTION_KEYS)
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise ConfigError(f"loss {name!r} does not take config keys {unknown}; it takes {sorted(allowed)}")
    for key, value in config.items():
        check_range(f"loss config {key!r}", value, LOSS_CONFIG_RANGES[key])
    if "mis_low" in config and "mis_high" in config and not config["mis_low"] < config["mis_high"]:
        raise ConfigError(f"loss config 'mis_low' must be below 'mis_high' (the band of importance weights kept), "
                          f"got {config['mis_low']!r} and {config['mis_high']!r}")


@dataclass(frozen=True)
class EnvSpec:
    name: str = "arithmetic"
    """A built-in suite ("arithmetic", "math", "reasoning_gym") or your own as "module:function",
    a function (spec, tokenizer, seed) -> EnvSuite (see lockstep/envs/types.py)."""
    digits: int | None = None
    """arithmetic / long_addition: operands have up to this many digits (None: 3 for arithmetic, 7
    for long_addition, whose worked answers are then 72 tokens); python_tool: the procedural
    problems' operands have this many."""
    max_turns: int = 1
    """arithmetic: > 1 lets the model retry a wrong answer after feedback (a multi-turn episode;
    a later correct answer earns half the reward of the turn before)."""
    max_tokens: int = 6
    """Most tokens sampled per turn (long_addition raises it to fit a worked answer)."""
    num_heldout: int = 200
    """Held-out problems for evaluation (math without test_path: taken from the end of path)."""
    pass_k: int = 8
    """pass@k on the held-out set at the end of each stage (k samples at temperature 1); 0: off."""
    path: str = ""
    """math: training rows, a .jsonl or .parquet file with `problem` (or `question`) and `answer`.
    code: rows of `prompt` and `tests` (empty: the shipped problems). python_tool: rows of
    `problem` and `answer` (empty: procedural arithmetic that is worth computing)."""
    test_path: str = ""
    """math: held-out rows in the same format (empty: the last num_heldout rows of path)."""
    task: str = ""
    """reasoning_gym: the procedural task, by its registered name (e.g. "basic_arithmetic")."""
    size: int = 10000
    """reasoning_gym: how many training problems to draw from the task."""
    prompt_template: str = "{question}\nAnswer: "
    """math / reasoning_gym: the prompt, with {question} replaced by the problem text."""
    chat_template: bool = False
    """math / reasoning_gym: wrap the prompt as a user message with the tokenizer's chat template."""
    reward: Literal["fraction", "all"] = "fraction"
    """code: the fraction of tests passed, or 1 only when all pass."""
    sandbox: Limits = field(default_factory=Limits)
    """code / python_tool: limits of the sandbox that runs model-written programs ([env.sandbox])."""
    retries: int = 2
    """Times an env step that raises or times out is retried before the group counts as failed."""
    timeout_s: float = 30.0
    """Deadline for one env call (initial observation or step)."""
    args: dict = field(default_factory=dict)
    """Free-form arguments for a user suite ("module:function")."""

    def __post_init__(self) -> None:
        _require(self.name in BUILTIN_ENVS or (isinstance(self.name, str) and ":" in self.name), "env.name",
                 f"one of {list(BUILTIN_ENVS)} or 'module:function'", self.name)
        if self.digits is None:  # frozen: resolved once, here
            object.__setattr__(self, "digits", 7 if self.name == "long_addition" else 3)
        for name, low in (("digits", 1), ("max_turns", 1), ("max_tokens", 1), ("num_heldout", 1), ("pass_k", 0),
                          ("size", 1), ("retries", 0)):
            v = getattr(self, name)
            _require(isinstance(v, int) and not isinstance(v, bool) and v >= low, f"env.{name}", f"an integer >= {low}", v)
        _require(self.digits <= 9, "env.digits", "an integer in [1, 9]", self.digits)
        _require(self.timeout_s > 0, "env.timeout_s", "a number > 0", self.timeout_s)
        _require(self.reward in ("fraction", "all"), "env.reward", "'fraction' or 'all'", self.reward)
        _require(isinstance(self.sandbox, Limits), "env.sandbox", "a table of sandbox limits", self.sandbox)
        _require(self.name != "math" or bool(self.path), "env.path", "a .jsonl or .parquet file when env.name is 'math'", self.path)
        _require(self.name != "reasoning_gym" or bool(self.task), "env.task",
                 "a reasoning_gym task name when env.name is 'reasoning_gym'", self.task)
        _require("{question}" in self.prompt_template, "env.prompt_template", "a string containing {question}", self.prompt_template)


STAGE_DEFAULTS: dict[str, dict] = {
    # The embedded default's tuned values (measured on the built-in model, see default_stages): a
    # user-written [[stages]] block gets them too. RL at 1e-3 took a warmed-up model from 0.285 to
    # 0.000 held-out accuracy within 50 steps; 2e-4 keeps it learning.
    "sft": {"learning_rate": 3e-3, "batch_size": 128, "eval_every": 5},
    "rl": {"learning_rate": 2e-4, "batch_size": 64, "eval_every": 25},
}
"""Per stage kind, the values of fields left unset (an explicit value always wins)."""


STAGE_LEARNING_RATE = Range(0.0, 1.0, low_open=True, high_open=True)
"""A stage's learning rate: Adam's range (ADAM_RANGES) less 0, which would train nothing."""
TRUNCATED_REWARD = Range(-1e6, 1e6)
"""Rewards are scores (the built-in envs' lie in [0, 1]); a finite bound keeps a NaN or inf from TOML
out of the advantages."""


@dataclass(frozen=True)
class StageSpec:
    kind: Literal["sft", "rl"] = "rl"
    """"sft": cross-entropy on correct examples; "rl": sample, reward, advantage, policy loss."""
    steps: int = 100
    """Optimizer steps in this stage (an RL stage may stop earlier, see max_seconds/target_accuracy)."""
    learning_rate: float | None = None
    """None: the stage kind's default (STAGE_DEFAULTS)."""
    batch_size: int | None = None
    """sft: examples per step (None: the kind's default)."""
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
    eval_every: int | None = None
    """Evaluate held-out greedy accuracy every this many steps (and at the end); None: the kind's
    default."""
    dataset: str = ""
    """sft: a .jsonl or .parquet file of `prompt` / `completion` rows (empty: the env's own
    solved examples)."""
    loss_config: dict = field(default_factory=dict)
    """rl: the loss's config, e.g. {tis_cap = 2.0} or PPO's clip thresholds."""
    truncation: Literal["keep", "mask", "penalize"] = "penalize"
    """rl: samples that hit max_tokens: "mask" takes them out of the loss and the advantage
    baseline, "penalize" sets their reward to truncated_reward, "keep" leaves them as scored."""
    truncated_reward: float = 0.0
    stale_policy: Literal["regenerate", "drop"] = "regenerate"
    """rl: a group past max_staleness is issued again ("regenerate") or dropped; both are counted."""

    def __post_init__(self) -> None:
        p = f"stages[{self.kind}]"
        _require(self.kind in STAGE_DEFAULTS, f"{p}.kind", "'sft' or 'rl'", self.kind)
        for name, value in STAGE_DEFAULTS[self.kind].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)  # frozen: resolved once, here
        for name in ("steps", "batch_size", "prompts_per_step", "eval_every"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 1, f"{p}.{name}", "an integer >= 1", v)
        _require(isinstance(self.group_size, int) and self.group_size >= 2, f"{p}.group_size", "an integer >= 2", self.group_size)
        _require(isinstance(self.max_staleness, int) and self.max_staleness >= 0, f"{p}.max_staleness", "an integer >= 0", self.max_staleness)
        check_range(f"{p}.learning_rate", self.learning_rate, STAGE_LEARNING_RATE)
        check_range(f"{p}.truncated_reward", self.truncated_reward, TRUNCATED_REWARD)
        _require(isinstance(self.temperature, (int, float)) and 0 < self.temperature <= 2, f"{p}.temperature", "a number in (0, 2]", self.temperature)
        _require(self.max_seconds >= 0 and 0 <= self.target_accuracy <= 1, f"{p}.max_seconds/target_accuracy", ">= 0 and accuracy in [0, 1]", (self.max_seconds, self.target_accuracy))
        _require(self.advantage in ADVANTAGE_ESTIMATORS, f"{p}.advantage", f"one of {list(ADVANTAGE_ESTIMATORS)}",
                 self.advantage)
        _require(self.truncation in ("keep", "mask", "penalize"), f"{p}.truncation", "'keep', 'mask' or 'penalize'", self.truncation)
        _require(self.stale_policy in ("regenerate", "drop"), f"{p}.stale_policy", "'regenerate' or 'drop'", self.stale_policy)
        _require(self.kind == "sft" or not self.dataset, f"{p}.dataset", "empty for an rl stage (rl data comes from [env])", self.dataset)


def default_stages() -> tuple[StageSpec, ...]:
    return (
        # Warm-up (3e-3, batches of 128): stop as soon as held-out accuracy passes 30%, leaving the
        # rest to RL. Evaluated every 5 steps: accuracy can jump from 15% to 60% within 25 steps.
        StageSpec(kind="sft", steps=600, target_accuracy=0.3),
        # GRPO (2e-4) until held-out accuracy reaches 85% (the final eval then repeats that exact
        # greedy result) or 400 s pass. Staleness 2 rather than 1: with half the groups dropped for
        # zero variance, leftovers from the older in-flight batch are otherwise discarded as stale.
        StageSpec(kind="rl", steps=3000, prompts_per_step=16, group_size=8, max_staleness=2, max_seconds=400.0,
                  target_accuracy=0.85),
    )


DRAFTERS = ("off", "suffix", "model")
"""Speculative-decoding drafters by name: `rollout.speculative.drafter`, `lockstep check consistency
--speculative`, `lockstep serve --speculative`; engine/drafters.py builds them."""


@dataclass(frozen=True)
class SpeculativeSpec:
    """Speculative decoding in the generator: drafts verified in the decode step's forward. What is
    sampled and every logprob stay exactly those of plain decoding; only the speed changes."""

    drafter: str = "off"
    """"off"; "suffix": model-free drafts from the prompt, the group's other samples and the last
    completions of the same prompt; "model": a small draft model that learns online from the
    generator's samples (engine/draft_model.py)."""
    draft_tokens: int = 4
    """Tokens drafted per row and decode step (k)."""
    max_ngram: int = 4
    """suffix: the longest suffix of a row matched against the index."""
    window: int = 16
    """suffix: earlier completions of each prompt kept for drafting."""
    draft_layers: int = 1
    """model: decoder layers of the draft, taken from the policy's first layers at start."""
    draft_model: str = ""
    """model: a trained draft in a transformers directory instead (its tokenizer must be the
    policy's); empty: the early exit of the policy."""
    draft_train: bool = True
    """model: distil the generator's samples into the draft while the run goes (a background thread)."""
    draft_lr: float = 1e-3
    draft_batch: int = 32
    """model: samples per distillation step; a step runs each time this many new ones finished."""
    draft_updates: int = 2
    """model: optimizer steps per `draft_batch` new samples (the newest and a replay of earlier ones)."""
    draft_timeout_s: float = 10.0
    """A drafter call that takes longer is abandoned: that rollout call decodes on without drafts,
    the timeout is counted, and the next call starts the drafter afresh. 0: no deadline (drafter
    calls then run inline, saving a thread handoff of ~50 us a decode step)."""
    auto: bool = False
    """Draft or not, each decode step, from the measured cost of a step and the measured accepted
    drafts: speculation turns itself off where it does not pay (many rows, poor drafts) and back on
    where it does."""

    def __post_init__(self) -> None:
        p = "rollout.speculative"
        _require(self.drafter in DRAFTERS, f"{p}.drafter", f"one of {list(DRAFTERS)}", self.drafter)
        _require(isinstance(self.draft_tokens, int) and 1 <= self.draft_tokens <= 64, f"{p}.draft_tokens",
                 "an integer in [1, 64]", self.draft_tokens)
        _require(isinstance(self.max_ngram, int) and 1 <= self.max_ngram <= 64, f"{p}.max_ngram", "an integer in [1, 64]",
                 self.max_ngram)
        _require(isinstance(self.window, int) and 0 <= self.window <= 4096, f"{p}.window", "an integer in [0, 4096]",
                 self.window)
        _require(isinstance(self.auto, bool), f"{p}.auto", "true or false", self.auto)
        _require(isinstance(self.draft_timeout_s, (int, float)) and 0 <= self.draft_timeout_s <= 3600,
                 f"{p}.draft_timeout_s", "seconds in [0, 3600]", self.draft_timeout_s)
        _require(isinstance(self.draft_layers, int) and 1 <= self.draft_layers <= 64, f"{p}.draft_layers",
                 "an integer in [1, 64]", self.draft_layers)
        _require(isinstance(self.draft_model, str), f"{p}.draft_model", "a directory path or empty", self.draft_model)
        _require(isinstance(self.draft_train, bool), f"{p}.draft_train", "true or false", self.draft_train)
        _require(isinstance(self.draft_lr, (int, float)) and 0 < self.draft_lr < 1, f"{p}.draft_lr", "a number in (0, 1)",
                 self.draft_lr)
        _require(isinstance(self.draft_batch, int) and 1 <= self.draft_batch <= 1024, f"{p}.draft_batch",
                 "an integer in [1, 1024]", self.draft_batch)
        _require(isinstance(self.draft_updates, int) and 1 <= self.draft_updates <= 64, f"{p}.draft_updates",
                 "an integer in [1, 64]", self.draft_updates)

    def sampler_options(self) -> dict:
        """The Sampler's speculation arguments (the drafter itself aside)."""
        return {"draft_tokens": self.draft_tokens, "auto": self.auto,
                "draft_timeout": float(self.draft_timeout_s) if self.draft_timeout_s else None}

    def drafter_options(self) -> dict:
        if self.drafter == "suffix":
            return {"max_ngram": self.max_ngram, "window": self.window}
        if self.drafter == "model":
            return {"layers": self.draft_layers, "path": self.draft_model or None, "train": self.draft_train,
                    "lr": float(self.draft_lr), "batch": self.draft_batch, "updates": self.draft_updates}
        return {}


@dataclass(frozen=True)
class ForkSpec:
    """Episode forking for multi-turn envs ([rollout.fork]): every training episode still running
    after `turn` turns is snapshotted and continued as `branches` branches from the same state.
    The shared prefix then learns from its branches' mean reward against the group's other
    episodes, and each continuation from its own reward against that mean (per-turn advantages)."""

    turn: int = 0
    """Fork after this many turns (0: never)."""
    branches: int = 2
    """Continuations per forked episode (the episode itself is one)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.turn, int) and not isinstance(self.turn, bool) and 0 <= self.turn <= 64,
                 "rollout.fork.turn", "an integer in [0, 64]", self.turn)
        _require(isinstance(self.branches, int) and not isinstance(self.branches, bool) and 2 <= self.branches <= 64,
                 "rollout.fork.branches", "an integer in [2, 64]", self.branches)


@dataclass(frozen=True)
class RolloutSpec:
    speculative: SpeculativeSpec = field(default_factory=SpeculativeSpec)
    fork: ForkSpec = field(default_factory=ForkSpec)
    replicas: int | str = 1
    """Generator actors behind the router (a prompt group stays on one replica); "auto": one per
    4 CPUs of the budget to start with (runtime/plan.py), then as many as the allocator measures
    to be fastest, up to `max_replicas` (runtime/allocator.py)."""
    max_replicas: int = 4
    """With replicas = "auto": the most generator replicas the allocator runs (each holds a copy of
    the model; never more than one per CPU of the budget)."""
    weight_sync: str = "rolling"
    """How an asynchronous stage's new weights reach the replicas: "rolling" (one replica at a
    time while the others sample) or "pause" (every replica held at a step boundary, swapped,
    released: the fleet-wide pause most RL frameworks make). See runtime/fleet.py."""

    def __post_init__(self) -> None:
        _require(self.replicas == "auto" or (isinstance(self.replicas, int) and not isinstance(self.replicas, bool)
                                             and 1 <= self.replicas <= 64),
                 "rollout.replicas", 'an integer in [1, 64] or "auto"', self.replicas)
        _require(isinstance(self.max_replicas, int) and not isinstance(self.max_replicas, bool)
                 and 1 <= self.max_replicas <= 64, "rollout.max_replicas", "an integer in [1, 64]", self.max_replicas)
        _require(self.weight_sync in ("rolling", "pause"), "rollout.weight_sync", '"rolling" or "pause"',
                 self.weight_sync)


@dataclass(frozen=True)
class RuntimeSpec:
    ray_address: str = ""
    """Empty: start a local Ray instance; otherwise join this cluster address."""
    cpus: int = 0
    """CPUs this run may use for its actors and threads (0: every core of the machine); the job
    service sets it to its slot's share."""
    gpus: int = -1
    """GPUs this run may use with model.device = "cuda" (-1: the machine's, as CUDA_VISIBLE_DEVICES
    or the NVIDIA driver lists them; set it when joining a cluster through ray_address)."""
    generator_threads: int = 1
    trainer_threads: int = 1
    env_workers: int = 1
    call_timeout_s: float = 300.0
    """Deadline for any cross-component call; a hang becomes an error."""
    checkpoint_every: int = 200
    """Save a checkpoint every this many optimizer steps (0: only at stage ends)."""
    keep_checkpoints: int = 3
    """Periodic checkpoints kept (oldest deleted first); `final` is always kept."""
    max_restarts: int = 3
    """Times Ray restarts a crashed actor; its in-flight groups are replayed (a crashed trainer
    resumes from the last checkpoint)."""
    placement: str = "pack"
    """"pack": wherever Ray schedules the actors; "spread": the trainer on the Ray head node, the
    generator replicas and env workers over the other nodes, each preferring its node (soft
    affinity: an actor whose node is lost is restarted on a node left)."""
    allocator: bool = True
    """An asynchronous RL stage re-plans its threads, env workers and CPU request from measurements
    (runtime/allocator.py); false keeps trainer_threads, generator_threads and env_workers as set."""
    allocator_window: int = 25
    """RL steps per allocator window: what each decision measures before it is taken."""
    allow_mixed_forward: bool = False
    """Run even when a trainer rank or generator replica would compute other bits than the trainer
    (another forward path, kernel build, CPU instruction set, GPU, library: engine/fingerprint.py).
    False (the default) refuses such a run at start, naming the fields, and keeps such a replica
    out of the fleet when it joins later; true runs with it, logs the differences (forward.json in
    the run directory) and leaves the mismatch to the metrics (mismatch/*)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.allocator, bool), "runtime.allocator", "true or false", self.allocator)
        _require(isinstance(self.allow_mixed_forward, bool), "runtime.allow_mixed_forward", "true or false",
                 self.allow_mixed_forward)
        _require(isinstance(self.allocator_window, int) and not isinstance(self.allocator_window, bool)
                 and self.allocator_window >= 1, "runtime.allocator_window", "an integer >= 1", self.allocator_window)
        _require(self.placement in ("pack", "spread"), "runtime.placement", '"pack" or "spread"', self.placement)
        _require(isinstance(self.cpus, int) and self.cpus >= 0, "runtime.cpus", "an integer >= 0", self.cpus)
        _require(isinstance(self.gpus, int) and not isinstance(self.gpus, bool) and self.gpus >= -1, "runtime.gpus",
                 "an integer >= 0, or -1 (the machine's)", self.gpus)
        for name in ("generator_threads", "trainer_threads", "env_workers"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 1, f"runtime.{name}", "an integer >= 1", v)
        _require(self.call_timeout_s > 0, "runtime.call_timeout_s", "a number > 0", self.call_timeout_s)
        _require(isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0, "runtime.checkpoint_every", "an integer >= 0", self.checkpoint_every)
        _require(isinstance(self.keep_checkpoints, int) and self.keep_checkpoints >= 1, "runtime.keep_checkpoints", "an integer >= 1", self.keep_checkpoints)
        _require(isinstance(self.max_restarts, int) and self.max_restarts >= 0, "runtime.max_restarts", "an integer >= 0", self.max_restarts)


@dataclass(frozen=True)
class TrainSpec:
    """The trainer's data parallelism ([train]). A step's datums are cut into `micro_batches`
    contiguous micro-batches whose gradients accumulate in order; with `replicas` > 1 the
    micro-batches are shared out over that many trainer processes (torch.distributed, gloo on CPU)
    and their gradients summed in micro-batch order (engine/data_parallel.py), so a run is bit for
    bit the same for any number of replicas at the same `micro_batches`."""

    replicas: int = 1
    micro_batches: int = 0
    """0: as many as replicas (1 for one trainer: the whole batch in one pass)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.replicas, int) and not isinstance(self.replicas, bool) and 1 <= self.replicas <= 64,
                 "train.replicas", "an integer in [1, 64]", self.replicas)
        _require(isinstance(self.micro_batches, int) and not isinstance(self.micro_batches, bool)
                 and 0 <= self.micro_batches <= 4096, "train.micro_batches", "an integer in [0, 4096]", self.micro_batches)
        _require(self.micro_batches == 0 or self.micro_batches >= self.replicas, "train.micro_batches",
                 f"0 or at least train.replicas ({self.replicas}), so that every replica has work", self.micro_batches)

    @property
    def micro(self) -> int:
        return self.micro_batches or self.replicas


@dataclass(frozen=True)
class RunSpec:
    model: ModelSpec = field(default_factory=ModelSpec)
    env: EnvSpec = field(default_factory=EnvSpec)
    stages: tuple[StageSpec, ...] = field(default_factory=default_stages)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    seed: int = 0

    def __post_init__(self) -> None:
        _require(len(self.stages) >= 1, "stages", "at least one stage", self.stages)
        _require(self.model.device == "cpu" or self.rollout.speculative.drafter == "off", "rollout.speculative.drafter",
                 '"off" with model.device = "cuda" (speculative decoding runs on the CPU path only, for now)',
                 self.rollout.speculative.drafter)
        for i, stage in enumerate(self.stages):
            if stage.kind == "rl":
                try:
                    check_loss(stage.loss, dict(stage.loss_config))
                except ConfigError as e:
                    raise ConfigError(f"stages[{i}].loss: {e}") from None
