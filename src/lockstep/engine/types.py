"""The engine's contract: what callers pass in and get back.

Shapes follow Tinker's conventions (see docs/architecture.md): a datum's `model_input` has N tokens,
and every per-token array in `loss_fn_inputs` has shape (N,), where position i predicts
`target_tokens[i]`. Containers are frozen; arrays are NumPy so that callers (the runtime, the API
workers) need not build torch tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

import numpy as np

from lockstep.config.types import ConfigError, check_adam

if TYPE_CHECKING:  # the API process imports this module and never torch
    import torch

StopReason = Literal["stop", "length"]


class EngineError(ValueError):
    """A user error detected by the engine: the message says what is wrong and what is expected."""


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request."""

    max_tokens: int = 32
    """Upper bound on new tokens per sample."""
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus mass kept, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 disables."""
    stop: tuple[int | str, ...] | None = None
    """Token ids and/or strings that end a sample. None keeps EOS stopping; () disables all stops."""
    seed: int | None = None
    """Makes sampling reproducible: the same seed and prompt give the same samples, whatever else
    is in the batch."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise EngineError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise EngineError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise EngineError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if self.stop is not None:
            for s in self.stop:
                if isinstance(s, bool) or not isinstance(s, (int, str)) or s == "":
                    raise EngineError(f"stop entries must be token ids or non-empty strings, got {s!r}")


@dataclass(frozen=True)
class SampleRequest:
    """One prompt to be sampled `num_samples` times; the prompt's prefill is shared."""

    prompt: tuple[int, ...]
    """Prompt token ids."""
    params: SamplingParams = field(default_factory=SamplingParams)
    num_samples: int = 1
    """Independent samples of this prompt."""
    prompt_logprobs: bool = False
    """Also return log p(prompt[i] | prompt[:i]) for every prompt position (entry 0 is NaN)."""
    adapter: "AdapterWeights | None" = None
    """The LoRA adapter snapshot this request samples with, on a shared base (engine/adapters.py);
    None: the bare base. Requests with different adapters share one batch, and each gets the
    tokens and logprobs it gets alone."""
    topk_prompt_logprobs: int = 0
    """k > 0: the k most likely next tokens and their logprobs at every prompt position
    (SampleResult.topk_prompt_logprobs). Logprobs here and in every extra below are the model's own
    (temperature 1, untruncated): the trainer's, bit for bit, whatever the sampling parameters."""
    topk_sample_logprobs: int = 0
    """k > 0: the k most likely tokens and their logprobs at every sampled position
    (SampledSequence.topk_logprobs), from the forward that sampled it."""
    target_prompt_ids: np.ndarray | None = field(default=None, compare=False)
    """int64 (len(prompt) - 1, K): row i names token ids to score at prompt position i + 1, -1 for
    none (SampleResult.target_prompt_logprobs); at least one id. Not compared by ==."""
    prompt_alt_tokens_k: int = 0
    """k > 0: k draws, with replacement and at the request's temperature (top-k/top-p not applied),
    from the next-token distribution at every prompt position after the first
    (SampleResult.prompt_alt_tokens)."""
    prompt_logprobs_last_n: int | None = None
    """Score only the last n prompt tokens (prompt_logprobs and topk_prompt_logprobs; earlier
    entries are unscored); needs prompt_logprobs and 1 <= n < len(prompt)."""

    def __post_init__(self) -> None:
        if len(self.prompt) == 0:
            raise EngineError("prompt must hold at least one token")
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise EngineError(f"num_samples must be an integer >= 1, got {self.num_samples!r}")
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            k = getattr(self, name)
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise EngineError(f"{name} must be an integer >= 0, got {k!r}")
        n = self.prompt_logprobs_last_n
        if n is not None:
            if not self.prompt_logprobs:
                raise EngineError("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(self.prompt) - 1:
                raise EngineError(f"prompt_logprobs_last_n must be an integer in [1, {len(self.prompt) - 1}] "
                                  f"(1 to len(prompt) - 1), got {n!r}")
        if self.target_prompt_ids is not None:
            _check_target_ids(self.target_prompt_ids, len(self.prompt))

    @property
    def scores_prompt(self) -> bool:
        """Whether anything is computed at the prompt's positions beyond its last."""
        return bool(self.prompt_logprobs or self.topk_prompt_logprobs or self.prompt_alt_tokens_k
                    or self.target_prompt_ids is not None)


def _check_target_ids(ids: np.ndarray, prompt_len: int) -> None:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 2:
        raise EngineError("target_prompt_ids must be a 2-D int64 array (len(prompt) - 1, K)")
    if ids.shape[0] != prompt_len - 1 or ids.shape[1] < 1:
        raise EngineError(f"target_prompt_ids must have len(prompt) - 1 = {prompt_len - 1} rows and at least one "
                          f"column, got shape {list(ids.shape)}")
    if ids.size and int(ids.min()) < -1:
        raise EngineError("target_prompt_ids holds ids below -1 (-1 means none)")
    if not bool((ids >= 0).any()):
        raise EngineError("target_prompt_ids names no token id (every cell is -1)")


@dataclass(frozen=True, eq=False)
class TokenLogprobs:
    """Token ids and the model's logprob of each at N positions: top-k lists (larger logprob first,
    then smaller token id) or draws. A position that was not scored holds ids -1 and logprobs NaN."""

    token_ids: np.ndarray
    """int64 (N, k)."""
    logprobs: np.ndarray
    """float32 (N, k)."""

    def __eq__(self, other: object) -> bool:  # bit for bit (NaN rows equal)
        return (isinstance(other, TokenLogprobs) and np.array_equal(self.token_ids, other.token_ids)
                and np.array_equal(self.logprobs.view(np.uint32), other.logprobs.view(np.uint32)))

    __hash__ = None


@dataclass(frozen=True)
class SampledSequence:
    """One completion."""

    tokens: tuple[int, ...]
    """New tokens, including the stop token or the tokens that completed a stop string."""
    logprobs: tuple[float, ...]
    """Per-token log-probability under the distribution actually sampled from (after temperature,
    top-k and top-p); at temperature 1 with no truncation this is the model's own log p."""
    stop_reason: StopReason
    """"stop" for EOS or a stop match, "length" when max_tokens was reached."""
    policy_version: int
    """The oldest weights version that produced any token of this sequence (staleness is
    measured from it)."""
    token_versions: tuple[int, ...] = ()
    """The weights version behind each token; it changes mid-sequence after a hot-swap."""
    topk_logprobs: TokenLogprobs | None = None
    """(len(tokens), k): the top-k at each sampled position, when the request asked
    (SampleRequest.topk_sample_logprobs)."""


@dataclass(frozen=True)
class SampleResult:
    """All samples of one request."""

    sequences: tuple[SampledSequence, ...]
    prompt_logprobs: tuple[float, ...] | None = None
    """One entry per prompt token, the first NaN (and those before prompt_logprobs_last_n's); None
    unless requested."""
    topk_prompt_logprobs: TokenLogprobs | None = None
    """(len(prompt), k): row t is the top-k at prompt position t (row 0, and rows before
    prompt_logprobs_last_n's, unscored); None unless requested."""
    target_prompt_logprobs: np.ndarray | None = field(default=None, compare=False)
    """float32, the shape of SampleRequest.target_prompt_ids: the logprob of each named id, 0.0 where
    it was -1; None unless requested. Not compared by ==."""
    prompt_alt_tokens: TokenLogprobs | None = None
    """(len(prompt) - 1, k): row i holds the draws at prompt position i + 1; None unless requested."""


@dataclass(frozen=True)
class Datum:
    """One training example in Tinker's layout."""

    model_input: tuple[int, ...]
    """N input tokens."""
    loss_fn_inputs: Mapping[str, np.ndarray]
    """Per-token arrays of shape (N,): target_tokens (int), weights, logprobs, advantages, ..."""

    @staticmethod
    def from_tokens(tokens: Sequence[int], weights: Sequence[float] | None = None, **extra) -> "Datum":
        """Next-token datum: input tokens[:-1], targets tokens[1:], weights default to 1."""
        if len(tokens) < 2:
            raise EngineError("a datum needs at least 2 tokens (an input and a target)")
        n = len(tokens) - 1
        w = np.ones(n, np.float32) if weights is None else np.asarray(weights, np.float32)
        inputs = {"target_tokens": np.asarray(tokens[1:], np.int64), "weights": w}
        inputs.update({k: np.asarray(v) for k, v in extra.items()})
        return Datum(model_input=tuple(int(t) for t in tokens[:-1]), loss_fn_inputs=inputs)


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """Result of forward or forward_backward."""

    loss_fn_outputs: tuple[dict[str, np.ndarray], ...]
    """Per datum: "logprobs" (shape (N,)) and "elementwise_loss"."""
    metrics: dict[str, float]
    """Keys are "name:reduction" (Tinker's merge convention); "loss:sum" is always present."""


@dataclass(frozen=True)
class AdamParams:
    """AdamW hyperparameters for one optimizer step (Tinker defaults)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    grad_clip_norm: float = 0.0
    """Global L2 norm clip; 0 disables."""

    def __post_init__(self) -> None:
        # The API checks the same ranges; the trainer does not rely on it (1e30 leaves a model NaN).
        try:
            check_adam({f.name: getattr(self, f.name) for f in fields(self)})
        except ConfigError as e:
            raise EngineError(str(e)) from None


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapter shape: through peft on a Trainer's own model, or as an adapter of its own on a
    shared frozen base (engine/adapters.py)."""

    rank: int = 32
    alpha: float = 32.0
    target_modules: tuple[str, ...] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    )
    seed: int = 0
    """Seeds the adapter's initialisation."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise EngineError(f"lora rank must be an integer >= 1, got {self.rank!r}")
        if not self.target_modules:
            raise EngineError("lora target_modules must name at least one module")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise EngineError(f"lora alpha must be a finite number, got {self.alpha!r}")


@dataclass(frozen=True, eq=False)
class LoraFactors:
    """One target projection's LoRA update on a shared base: delta(x) = ((x A^T) B^T) * scaling."""

    a: "torch.Tensor"
    """A: (rank, in_features), float32 on the base's device."""
    b: "torch.Tensor"
    """B: (out_features, rank)."""
    scaling: float
    """alpha / rank, peft's convention."""


@dataclass(frozen=True, eq=False)
class AdapterWeights:
    """One LoRA adapter as a shared base's forward reads it (engine/multi_lora.py): its own small
    tensors, never a copy of the base. A trainer's adapter holds its parameters (requires_grad, updated
    in place by each optimizer step); a snapshot (`AdapterTrainer.snapshot()`) holds detached copies
    that never change, so a sampler row naming it reads one weights version throughout. Compared
    and hashed by identity."""

    name: str
    """Who it belongs to (a model id); only for messages and logs."""
    version: int
    """The weights version (the trainer's step when it was snapshotted)."""
    spec: LoraSpec
    """The shape it was made with: rank, alpha, targets."""
    factors: Mapping[tuple[int, str], LoraFactors]
    """(decoder layer index, target projection such as "q_proj") -> its factors; a projection with
    no entry has no update."""


@dataclass(frozen=True, eq=False)
class AdapterAssignment:
    """Which adapter each batch row of one forward uses (InvariantLM.hidden_states)."""

    adapters: tuple[AdapterWeights, ...]
    """The distinct adapters of the call."""
    rows: tuple[int, ...]
    """Per batch row: an index into `adapters`, or -1 for the bare base."""
    tokens: tuple[int, ...] | None = None
    """Per batch row: how many of its tokens, from the call's first, use the adapter; the rest (the
    padding a row carries past its own group's length) run on the bare base. None: all of them.
    The trainer sets it so that an adapter's gradient sums over exactly the rows it has alone."""

    def __post_init__(self) -> None:
        bad = [r for r in self.rows if not -1 <= r < len(self.adapters)]
        if bad:
            raise EngineError(f"adapter rows must index the {len(self.adapters)} adapters or be -1, got {bad[:5]}")
        if self.tokens is not None and len(self.tokens) != len(self.rows):
            raise EngineError(f"adapter tokens: one count per row ({len(self.rows)}), got {len(self.tokens)}")


@dataclass(frozen=True)
class TrainGroup:
    """One model's part of a packed forward or forward_backward (engine/packed.py)."""

    model: Any
    """The model's AdapterTrainer (engine/adapters.py) on the shared base; None: the bare base
    (forward only, nothing to train)."""
    data: tuple[Datum, ...]
    """Its datums, as it would pass them alone."""
    loss_fn: str = "cross_entropy"
    loss_fn_config: Mapping[str, float] | None = None


@dataclass(frozen=True)
class ForwardFingerprint:
    """What decides the bits a component's forward computes (engine/fingerprint.py measures it).

    Two components with equal fingerprints compute the same logprobs, bit for bit, from the same
    weights and tokens: what the sampler-trainer agreement rests on. Each field is something that
    was seen, or is documented, to change a result when it differs between two processes."""

    path: str
    """"fused" (the C++ kernels), "eager" (pure PyTorch: e.g. a node without the fused build) or
    "triton"."""
    kernel_build: str
    """The loaded fused build's tag (engine/kernels tag(): sources, flags, torch, CPU); "" when the
    path is not "fused"."""
    device: str
    """"cpu (x86_64)", or "cuda: <GPU name>, sm_<compute capability>"."""
    dtype: str
    isa: tuple[str, ...]
    """The CPU's instruction-set flags that select another code path in MKL, ATen or libm (sorted;
    engine/fingerprint.py RESULT_ISA says why each); () on a GPU, whose forward does not run there."""
    aten_cpu: str
    """ATen's CPU kernel level (torch.backends.cpu.get_cpu_capability(): "AVX2", "AVX512", ...):
    the eager path's elementwise ops differ by an ulp between levels; "" on a GPU."""
    mkl: str
    """MKL's version, its CNR mode (MKL_CBWR, strict or not) and the branch MKL picks for this CPU;
    "none" without MKL, "" on a GPU."""
    matmul_precision: str
    """torch's float32 matmul precision ("highest": IEEE products; lower lets oneDNN use bf16/tf32)."""
    libraries: str
    """torch and the C library (whose libm the kernels call), plus Triton and CUDA on that path."""
    probe: str
    """sha256 (16 hex digits) of the logprobs of a fixed 16-token forward through the loaded model:
    a measurement that catches what no field above names."""

    def differences(self, reference: "ForwardFingerprint") -> tuple[str, ...]:
        """One phrase per field in which this forward differs from `reference`'s, this one's value
        first: ("path 'eager' vs 'fused'", ...); () when they compute the same bits."""
        out = []
        for name in self.__dataclass_fields__:
            mine, theirs = getattr(self, name), getattr(reference, name)
            if mine == theirs:
                continue
            if name == "isa":  # the flags only one side has: a full list would bury them
                mine, theirs = " ".join(sorted(set(mine) - set(theirs))), " ".join(sorted(set(theirs) - set(mine)))
            out.append(f"{name} {mine!r} vs {theirs!r}")
        return tuple(out)
