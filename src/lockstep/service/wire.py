"""Tinker wire formats: protobuf bodies and results, JSON ModelInputs and TensorData, validation.

The schema is the SDK's own compiled `tinker_public_pb2` (the `tinker` package is Apache-2.0 and
pinned in our dependencies), loaded from its file so that importing it pulls in none of the SDK's
client machinery. Torch-free: the API process decodes and validates here, and never holds a model.
Every problem in a body raises ServiceError (a 400 with what to fix) before anything is stored.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from lockstep.config.types import LOSS_INPUTS, missing_loss_input
from lockstep.service.types import ServiceError

FLOAT_KEYS = ("weights", "logprobs", "advantages", "sequence_ratio_mask", "clip_low_threshold", "clip_high_threshold")
KNOWN_KEYS = ("target_tokens", *FLOAT_KEYS)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


@functools.lru_cache(maxsize=1)
def pb2():
    """`tinker.proto.tinker_public_pb2`, imported from its file (not through `tinker/__init__`)."""
    spec = importlib.util.find_spec("tinker")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the `tinker` package (its protobuf schema) is required: pip install tinker==0.38.0")
    path = Path(next(iter(spec.submodule_search_locations))) / "proto" / "tinker_public_pb2.py"
    mod_spec = importlib.util.spec_from_file_location("lockstep_tinker_public_pb2", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def check_name(name: Any, what: str) -> str:
    """Checkpoint and run names: no slashes, no dots-only names, nothing that looks like a path."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name in (".", "..") or ".." in name:
        raise ServiceError(f"{what} {shown(name)}: use 1-128 letters, digits, '_', '.', ':', '-' (no '/', no '..')")
    return name


def shown(value: Any, limit: int = 80) -> str:
    """repr() of a client's value for an error message, cut short: never echo megabytes back."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


# -- tensors -------------------------------------------------------------------------------------
_PB_DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}


def _elements(shape: Sequence[int], max_elements: int, what: str) -> int:
    """The element count of a client's shape, in Python ints (numpy's product wraps at 2^64), bounded
    before anything is allocated from it."""
    if any(d < 0 for d in shape):
        raise ServiceError(f"{what}: shape {shown(list(shape))} has a negative dimension")
    count = math.prod(shape)
    if count > max_elements:
        raise ServiceError(f"{what}: shape {shown(list(shape))} holds {count} values; at most {max_elements} fit here")
    return count


def _csr(values: np.ndarray, crow: np.ndarray, col: np.ndarray, shape: Sequence[int], max_elements: int,
         what: str) -> np.ndarray:
    if len(shape) != 2:
        raise ServiceError(f"{what}: a sparse tensor needs a 2-D shape, got {shown(list(shape))}")
    _elements(shape, max_elements, what)
    rows, cols = int(shape[0]), int(shape[1])
    if len(crow) != rows + 1 or len(col) != len(values) or (len(col) and (col.min() < 0 or col.max() >= cols)):
        raise ServiceError(f"{what}: inconsistent sparse CSR indices for shape {list(shape)}")
    if np.any(np.diff(crow) < 0) or crow[0] != 0 or crow[-1] != len(values):
        raise ServiceError(f"{what}: sparse crow_indices must start at 0, rise, and end at the value count")
    out = np.zeros((rows, cols), values.dtype)
    for r in range(rows):
        out[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
    return out


def tensor_from_pb(t, what: str, max_elements: int) -> np.ndarray:
    """A TensorData message as an array of at most `max_elements` values (its shape is the client's:
    bounded before any allocation is sized from it)."""
    dtype = _PB_DTYPES.get(t.dtype)
    if dtype is None:
        raise ServiceError(f"{what}: dtype {t.dtype} is not supported (float32, int64 or int32)")
    shape = [int(x) for x in t.shape]
    try:
        if t.WhichOneof("encoding") == "sparse_csr":
            s = t.sparse_csr
            values = np.frombuffer(s.values, dtype)
            crow, col = np.frombuffer(s.crow_indices, np.int64), np.frombuffer(s.col_indices, np.int64)
            return _csr(values, crow, col, shape, max_elements, what)
        flat = np.frombuffer(t.dense, dtype)
    except ValueError as e:
        raise ServiceError(f"{what}: tensor bytes do not match their dtype ({e})") from None
    if shape and _elements(shape, max_elements, what) != flat.size:
        raise ServiceError(f"{what}: {flat.size} values do not fill shape {shape}")
    if flat.size > max_elements:
        raise ServiceError(f"{what}: {flat.size} values; at most {max_elements} fit here")
    return flat.reshape(shape) if shape else flat


# -- model inputs --------------------------------------------------------------------------------
def tokens_from_chunks_pb(chunks, what: str) -> tuple[int, ...]:
    out: list[int] = []
    for i, c in enumerate(chunks):
        kind = c.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ServiceError(f"{what} chunk {i}: {kind} chunks are not supported (text models only)")
        raw = c.encoded_text.tokens
        if len(raw) % 4:
            raise ServiceError(f"{what} chunk {i}: {len(raw)} token bytes is not a whole number of int32 tokens")
        out.extend(np.frombuffer(raw, np.int32).tolist())
    return tuple(out)


def tokens_from_model_input(obj: Any, what: str, max_tokens: int | None = None) -> tuple[int, ...]:
    """A JSON ModelInput's tokens; more than `max_tokens` is refused before they are all read."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("chunks"), list):
        raise ServiceError(f"{what}: expected a ModelInput {{chunks: [...]}}")
    out: list[int] = []
    for i, c in enumerate(obj["chunks"]):
        if not isinstance(c, Mapping) or c.get("type", "encoded_text") != "encoded_text":
            kind = shown(c.get("type")) if isinstance(c, Mapping) else type(c).__name__
            raise ServiceError(f"{what} chunk {i}: {kind} chunks are not supported (text models only)")
        toks = c.get("tokens")
        if not isinstance(toks, list):
            raise ServiceError(f"{what} chunk {i}: tokens must be a list of integers")
        if max_tokens is not None and len(out) + len(toks) > max_tokens:
            raise ServiceError(f"{what}: more than {max_tokens} tokens; at most {max_tokens} fit here")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise ServiceError(f"{what} chunk {i}: tokens must be a list of integers")
        out.extend(toks)
    return tuple(out)


def check_tokens(tokens: Sequence[int], vocab_size: int, what: str) -> None:
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ServiceError(f"{what}: token ids {shown(bad[:5])} are outside the vocabulary [0, {vocab_size})")


# -- forward_backward ----------------------------------------------------------------------------
MAX_DATA = 1024
"""Data per forward/forward_backward request (the SDK's own chunk length)."""


@dataclass(frozen=True)
class WireDatum:
    model_input: tuple[int, ...]
    loss_fn_inputs: dict[str, np.ndarray]


@dataclass(frozen=True)
class FwdBwd:
    model_id: str
    seq_id: int
    data: tuple[WireDatum, ...]
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool


def check_datum(i: int, model_input: tuple[int, ...], inputs: dict[str, np.ndarray], vocab_size: int,
                max_context: int | None = None) -> None:
    n = len(model_input)
    what = f"datum {i}"
    if n == 0:
        raise ServiceError(f"{what}: model_input is empty")
    if max_context is not None and n > max_context:
        raise ServiceError(f"{what}: {n} tokens do not fit the model's context of {max_context}")
    check_tokens(model_input, vocab_size, f"{what} model_input")
    if "target_tokens" not in inputs:
        raise ServiceError(f"{what}: loss_fn_inputs needs target_tokens (int64, shape ({n},))")
    for key, arr in inputs.items():
        if arr.shape != (n,):
            raise ServiceError(f"{what}: loss_fn_inputs[{key!r}] has shape {list(arr.shape)}, expected [{n}] "
                               f"(one per model_input token)")
        if key == "target_tokens":
            if not np.issubdtype(arr.dtype, np.integer):
                raise ServiceError(f"{what}: target_tokens must be int64, got {arr.dtype}")
            check_tokens(arr.tolist(), vocab_size, f"{what} target_tokens")
        elif not np.issubdtype(arr.dtype, np.floating):
            raise ServiceError(f"{what}: loss_fn_inputs[{key!r}] must be float32, got {arr.dtype}")
        elif not np.all(np.isfinite(arr)):
            raise ServiceError(f"{what}: loss_fn_inputs[{key!r}] contains NaN or inf")


def check_loss_inputs(fb: FwdBwd) -> None:
    """Every datum carries the inputs its (checked, built-in) loss needs: a missing one has no
    default to train on (config.types.LOSS_INPUTS)."""
    problem = missing_loss_input(fb.loss_fn, LOSS_INPUTS[fb.loss_fn], fb.loss_fn_config,
                                 (d.loss_fn_inputs.keys() for d in fb.data))
    if problem is not None:
        raise ServiceError(problem)


def _config(msg) -> dict[str, float]:
    cfg: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "number":
            cfg[k] = float(v.number)
        else:
            raise ServiceError(f"loss_fn_config[{shown(k)}]: only numbers are supported, got text {shown(v.text)}")
    for k, v in cfg.items():
        if not math.isfinite(v):
            raise ServiceError(f"loss_fn_config[{shown(k)}] must be finite, got {v}")
    return cfg


def parse_forward_backward(body: bytes):
    """A protobuf ForwardBackwardRequest, parsed but not decoded: its model_id and seq_id are known
    before its data is looked at (a request refused for its data still settles its seq_id)."""
    from google.protobuf.message import DecodeError

    msg = pb2().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise ServiceError(f"malformed protobuf ForwardBackwardRequest: {e}") from None
    if not msg.model_id:
        raise ServiceError("ForwardBackwardRequest needs model_id")
    return msg


def _token_count(msg, max_tokens: int | None) -> int:
    """Tokens in the request, from the chunks' byte lengths alone (nothing decoded yet)."""
    if not msg.data:
        raise ServiceError("ForwardBackwardRequest has no data; send at least one datum")
    if len(msg.data) > MAX_DATA:
        raise ServiceError(f"ForwardBackwardRequest has {len(msg.data)} data; at most {MAX_DATA} per request")
    total = token_count(msg)
    if max_tokens is not None and total > max_tokens:
        raise ServiceError(f"ForwardBackwardRequest has {total} tokens; at most {max_tokens} per request (the SDK "
                           f"chunks its batches below this)")
    return total


def token_count(msg) -> int:
    """A parsed ForwardBackwardRequest's input tokens, from the chunks' byte lengths."""
    return sum(len(c.encoded_text.tokens) // 4 for d in msg.data for c in d.model_input)


def forward_backward_from_pb(msg, *, max_tokens: int | None = None) -> FwdBwd:
    """The decoded request: its structure checked and its sizes bounded before any array is built
    (the caller checks it against the model with check_datum)."""
    _token_count(msg, max_tokens)
    data = []
    for i, d in enumerate(msg.data):
        tokens = tokens_from_chunks_pb(d.model_input, f"datum {i} model_input")
        unknown = set(d.loss_fn_inputs) - set(KNOWN_KEYS)
        if unknown:
            raise ServiceError(f"datum {i}: unknown loss_fn_inputs {shown(sorted(unknown))}; known: {list(KNOWN_KEYS)}")
        inputs = {k: tensor_from_pb(t, f"datum {i} loss_fn_inputs[{k!r}]", len(tokens))
                  for k, t in d.loss_fn_inputs.items()}
        data.append(WireDatum(tokens, inputs))
    return FwdBwd(msg.model_id, int(msg.seq_id), tuple(data), msg.loss_fn, _config(msg), bool(msg.forward_only))


def decode_forward_backward(body: bytes, *, max_tokens: int | None = None) -> FwdBwd:
    """parse_forward_backward, then forward_backward_from_pb (the worker re-reads stored bodies)."""
    return forward_backward_from_pb(parse_forward_backward(body), max_tokens=max_tokens)


def encode_forward_backward(fb: FwdBwd) -> bytes:
    """The inverse of decode_forward_backward (the worker re-reads what the API stored)."""
    p = pb2()
    msg = p.ForwardBackwardRequest(model_id=fb.model_id, seq_id=fb.seq_id, loss_fn=fb.loss_fn,
                                   forward_only=fb.forward_only)
    for k, v in fb.loss_fn_config.items():
        msg.loss_fn_config[k] = v
    for d in fb.data:
        pd = msg.data.add()
        pd.model_input.add().encoded_text.tokens = np.asarray(d.model_input, np.int32).tobytes()
        for k, arr in d.loss_fn_inputs.items():
            t = pd.loss_fn_inputs[k]
            dtype = np.int64 if np.issubdtype(arr.dtype, np.integer) else np.float32
            t.dense = np.ascontiguousarray(arr, dtype).tobytes()
            t.dtype = 2 if dtype is np.int64 else 1
            t.shape.extend(arr.shape)
    return msg.SerializeToString()


def encode_forward_output(outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]) -> bytes:
    """ForwardBackwardOutput: one ArrayRecord whose fields batch every datum's arrays."""
    p = pb2()
    msg = p.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    rec = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for key in (outputs[0].keys() if outputs else ()):
        arrays = [np.ascontiguousarray(o[key], np.float32) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt = rec.fields[key]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = 1
    return msg.SerializeToString()


def encode_sample_response(sequences: Sequence[tuple[Sequence[int], Sequence[float], str]],
                           prompt_logprobs: Sequence[float] | None) -> bytes:
    """SampleResponse: per sequence (tokens, logprobs, stop_reason "stop"|"length")."""
    return sample_response(sequences, prompt_logprobs).SerializeToString()


def sample_response(sequences: Sequence[tuple[Sequence[int], Sequence[float], str]],
                    prompt_logprobs: Sequence[float] | None):
    """The SampleResponse message (service/sample_extras.encode adds the extras)."""
    p = pb2()
    msg = p.SampleResponse()
    for tokens, logprobs, reason in sequences:
        s = msg.sequences.add()
        s.stop_reason = 0 if reason == "stop" else 1
        s.tokens = np.asarray(tokens, np.int32).tobytes()
        s.logprobs = np.asarray(logprobs, np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([math.nan if x is None else x for x in prompt_logprobs], np.float32).tobytes()
    return msg
