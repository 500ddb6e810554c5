"""The Tinker API's JSON request bodies, with every field typed and bounded.

Every field a tenant sends is hostile until checked: integers are range-checked here (the store's
INTEGER columns are 32-bit on PostgreSQL, SQLite's overflow at 2^63), strings have a length (which
also makes pydantic refuse lone surrogates, which the store cannot encode) and no control
characters, and free-form JSON (user_metadata) is bounded in depth and size and must read back as
strict JSON. A body that breaks a bound is a 400 naming the field, before anything is stored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from lockstep.config.types import ADAM_RANGES, ConfigError, Range, check_decay

MAX_SEQ = 2**31 - 1
"""seq_id, model_seq_id, sampling_session_seq_id: a 32-bit INTEGER column (and the protobuf's int32)."""
MAX_OFFSET = 2**31 - 1
MAX_TTL_S = 10 * 366 * 86400
"""ttl_seconds: ten years; the worker adds it to a datetime, which ends at year 9999."""
MAX_METADATA_BYTES = 64 * 1024
MAX_METADATA_DEPTH = 16
MAX_LORA_RANK = 1024
MAX_SAMPLES = 256
MAX_STOPS = 16
INT64 = 2**63

PRINTABLE = r"^[^\x00-\x1f\x7f]*$"
"""No control characters: PostgreSQL refuses NUL in text, and no id or name of ours has one."""


def Text(max_length: int, min_length: int = 0):  # noqa: N802 - a type, used like one
    """An id, a name, or text stored in a column or looked up: bounded, no control characters."""
    return Annotated[str, StringConstraints(min_length=min_length, max_length=max_length, pattern=PRINTABLE)]


def Free(max_length: int):  # noqa: N802 - a type, used like one
    """Text only ever stored inside JSON (tags, stop strings: "\n" is a common stop): bounded only.
    A length constraint still makes pydantic refuse lone surrogates."""
    return Annotated[str, StringConstraints(max_length=max_length)]


SessionId = Text(64, 1)
ObjectId = Text(160, 1)
"""Model and sampling-session ids ("{session}:train:{n}", "{model}:sample:{n}")."""
RequestId = Text(64, 1)
ModelName = Text(256, 1)
TinkerPath = Text(512, 1)
Name = Text(128)
Short = Text(32)
Line = Free(256)
Detail = Free(4096)
Seq = Annotated[int, Field(ge=1, le=MAX_SEQ)]
SeqFrom0 = Annotated[int, Field(ge=0, le=MAX_SEQ)]
Ttl = Annotated[int, Field(ge=0, le=MAX_TTL_S, description="0: no expiry")]


def bounded_json(value: Any) -> Any:
    """Free-form JSON a tenant stores and reads back: at most MAX_METADATA_DEPTH levels and
    MAX_METADATA_BYTES serialised, no NaN/inf, encodable as UTF-8 (what the answer will need)."""
    try:
        size = len(json.dumps(value, ensure_ascii=False, allow_nan=False).encode())
    except (ValueError, RecursionError, UnicodeEncodeError) as e:
        raise ValueError(f"must be plain JSON (no NaN or inf, valid unicode, at most {MAX_METADATA_DEPTH} levels): "
                         f"{type(e).__name__}") from None
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"is {size} bytes as JSON; at most {MAX_METADATA_BYTES}")
    stack = [(value, 1)]
    while stack:  # a loop, not recursion: the depth is what is being checked
        item, depth = stack.pop()
        if depth > MAX_METADATA_DEPTH:
            raise ValueError(f"is nested deeper than {MAX_METADATA_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return value


Metadata = Annotated[dict[str, Any], AfterValidator(bounded_json)]


def Ranged(bounds: Range):  # noqa: N802 - a type, used like one
    """A hyperparameter: a finite number in `bounds` (the config layer's range, which the engine
    checks again), refused with the range named."""

    def check(value: float) -> float:
        if not bounds.holds(value):
            raise ValueError(f"must be a number in {bounds}, got {value!r}")
        return value

    return Annotated[float, AfterValidator(check)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# -- sessions and models -------------------------------------------------------------------------
class CreateSession(Body):
    tags: list[Line] = Field(default=[], max_length=64)
    user_metadata: Metadata | None = None
    sdk_version: Text(128) = ""
    """Kept to its first 32 characters (a dev build's version string can be longer)."""


class SessionRef(Body):
    session_id: SessionId


class Finish(Body):
    reason: Metadata = {}
    detail: Detail | None = None


class LoraConfig(Body):
    rank: int = Field(default=32, ge=0, le=MAX_LORA_RANK, description="0: full fine-tuning")
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    """SDK 0.38 names the optimizer at creation (AdamOptimizerConfig, DimuonOptimizerConfig)."""

    type: Literal["adamw"] = Field(default="adamw", description="the only optimizer here: AdamW")


class CreateModel(Body):
    session_id: SessionId
    model_seq_id: SeqFrom0
    base_model: ModelName
    user_metadata: Metadata | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig | None = None


class ModelRef(Body):
    model_id: ObjectId


# -- training ------------------------------------------------------------------------------------
class Training(Body):
    """What every training request names first: the model and its place in the model's order."""

    model_id: ObjectId
    seq_id: Seq


class AdamParams(Body):
    """Every field of the SDK's AdamParams, each in its range (config.types.ADAM_RANGES, where the
    reasons are), with Tinker's defaults."""

    learning_rate: Ranged(ADAM_RANGES["learning_rate"]) = 1e-4
    beta1: Ranged(ADAM_RANGES["beta1"]) = 0.9
    beta2: Ranged(ADAM_RANGES["beta2"]) = 0.95
    eps: Ranged(ADAM_RANGES["eps"]) = 1e-12
    weight_decay: Ranged(ADAM_RANGES["weight_decay"]) = 0.0
    grad_clip_norm: Ranged(ADAM_RANGES["grad_clip_norm"]) = 0.0

    @model_validator(mode="after")
    def _decay(self):
        try:
            check_decay(self.learning_rate, self.weight_decay)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return self


class OptimStep(Training):
    adam_params: AdamParams = AdamParams()
    optimizer_params: Metadata | None = Field(
        default=None, description="SDK 0.38 sends a non-Adam optimizer's step here; refused (AdamW only)")

    @model_validator(mode="after")
    def _adam_only(self):
        if self.optimizer_params is not None:
            raise ValueError("optimizer_params (a non-Adam optimizer's step) is not supported: this server trains "
                             "with AdamW; send adam_params")
        return self


class SaveWeights(Training):
    path: Name | None = None
    ttl_seconds: Ttl | None = None
    user_metadata: Metadata | None = None
    sampling_session_seq_id: SeqFrom0 | None = None
    kind: Literal["snapshot", "inflight"] | None = None
    """SDK 0.38's SamplingClientKind: a fixed snapshot, or the model's shared inflight target."""
    overwrite: bool = False


class LoadWeights(Body):
    path: TinkerPath
    optimizer: bool = False
    model_id: ObjectId | None = None
    seq_id: Seq | None = None
    session_id: SessionId | None = None
    model_seq_id: SeqFrom0 | None = None
    user_metadata: Metadata | None = None


# -- sampling ------------------------------------------------------------------------------------
class CreateSamplingSession(Body):
    session_id: SessionId
    sampling_session_seq_id: SeqFrom0
    base_model: ModelName | None = None
    model_path: TinkerPath | None = None


StopStrings = Annotated[list[Line], Field(max_length=MAX_STOPS)]
StopTokens = Annotated[list[Annotated[int, Field(ge=0, le=MAX_SEQ)]], Field(max_length=MAX_STOPS)]


class SamplingParams(Body):
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_SEQ)
    seed: int | None = Field(default=None, ge=-INT64, lt=2 * INT64)
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_k: int = Field(default=-1, ge=-1, le=MAX_SEQ)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: Line | StopStrings | StopTokens | None = None


class Sample(Body):
    sampling_session_id: ObjectId | None = None
    seq_id: int | None = Field(default=None, ge=-INT64, lt=INT64)
    num_samples: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    prompt: dict[str, Any]
    sampling_params: SamplingParams = SamplingParams()
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=MAX_SEQ)
    topk_sample_logprobs: int = Field(default=0, ge=0, le=MAX_SEQ)
    prompt_alt_tokens_k: int = Field(default=0, ge=0, le=MAX_SEQ)
    prompt_logprobs_last_n: int | None = Field(default=None, ge=0, le=MAX_SEQ)
    target_prompt_logprobs: dict[str, Any] | None = None
    base_model: ModelName | None = None
    model_path: TinkerPath | None = None
    record_stability_info: bool | None = None
    """Keep each sampled sequence for provenance checks (service/stability.py)."""


# -- futures and listings ------------------------------------------------------------------------
class Retrieve(Body):
    request_id: RequestId
    allow_metadata_only: bool = False


class WeightsInfo(Body):
    tinker_path: TinkerPath


# -- checkpoint and session management (tinker_checkpoints.py, tinker_rest.py) -----------------
MIN_REST_TTL_S = 3600
RestTtl = Annotated[int, Field(ge=MIN_REST_TTL_S, le=MAX_TTL_S,
                               description="seconds from now: 1 hour to 10 years, as the SDK documents")]
ProjectId = Text(128, 1)


class SetTtl(Body):
    ttl_seconds: RestTtl | None
    """None removes the expiry."""


class SetProject(Body):
    project_id: ProjectId


class CopyWeights(Body):
    source_path: TinkerPath
    session_id: SessionId | None = None
    model_seq_id: SeqFrom0 | None = None
    destination_project_id: ProjectId | None = None
    ttl_seconds: RestTtl | None = None
    weights_access_token: Text(512) | None = None

    @model_validator(mode="after")
    def _destination(self):
        if (self.session_id is None) != (self.model_seq_id is None):
            raise ValueError("session_id and model_seq_id go together (the training run slot the copy takes)")
        if self.session_id is None and self.destination_project_id is None:
            raise ValueError("copy_weights needs destination_project_id, or session_id with model_seq_id")
        return self


class SaveWeightsExternal(Training):
    path: Name
    ttl_seconds: Ttl | None = None
    age_encryption_recipients: list[Text(1024, 1)] | None = Field(default=None, max_length=16)


class StatusQuery(Body):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(default=None, min_length=1, max_length=3)


class SearchOwner(Body):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[Text(128, 1)] | None = Field(default=None, min_length=1, max_length=10)


class SearchCursor(Body):
    last_created_at: str = Field(max_length=64)
    last_session_id: SessionId


class SessionSearch(Body):
    """The SDK's SessionSearchRequest (sent with exclude_none)."""

    session_id: SessionId | None = None
    project_ids: list[ProjectId] | None = Field(default=None, max_length=100)
    user_metadata: dict[Text(128, 1), Text(1024)] = Field(default={}, max_length=32)
    display_name: Text(256, 1) | None = None
    owner: SearchOwner = SearchOwner()
    statuses: list[StatusQuery] | None = Field(default=None, min_length=1, max_length=8)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: SearchCursor | None = None
