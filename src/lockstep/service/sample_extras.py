"""Tinker's sampling extras on the wire: topk_prompt_logprobs, topk_sample_logprobs,
target_prompt_logprobs, prompt_alt_tokens_k and prompt_logprobs_last_n.

The API checks a request's extras before it is stored, and the worker checks the stored body again
(`check`); `target_of` reads target_prompt_logprobs' JSON TensorData; `encode` writes the results
into the protobuf SampleResponse in the SDK 0.38 shapes (tinker/proto/response_conv.py reads them).
Torch-free: the API process imports this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from lockstep.service.types import ServiceError

MAX_LOGPROB_CELLS = 1 << 20
"""Values one extra of one request may return (k x the positions it covers): bounds the worker's
work and memory for it and its part of the response (8 MiB). Top-k widths are also at most the
model's vocabulary. Not an operator setting: the SDK's recipes ask for k <= 20 on prompts of a
few thousand tokens, far below it."""

MASK_TOKEN, MASK_LOGPROB = 0, -99999.0
"""What an unscored top-k cell holds on the wire (tinker.types.topk_logprobs.MASK_LOGPROB)."""

_TENSOR_KEYS = {"data", "dtype", "shape", "sparse_crow_indices", "sparse_col_indices"}


@dataclass(frozen=True)
class Target:
    """A request's target_prompt_logprobs."""

    ids: np.ndarray
    """int64 (len(prompt) - 1, K): token ids, -1 where the request names none."""
    csr: tuple[np.ndarray, np.ndarray] | None
    """A sparse request's (crow_indices, col_indices): the response keeps its layout; None: dense."""


def _cells(name: str, count: int, what: str) -> None:
    if count > MAX_LOGPROB_CELLS:
        raise ServiceError(f"{name} asks for {count:,} logprobs ({what}); this server returns at most "
                           f"{MAX_LOGPROB_CELLS:,} per extra of a request: lower it or split the request")


def check(body: Mapping[str, Any], prompt_len: int, vocab_size: int) -> Target | None:
    """ServiceError naming the field and its bound for any extra this request may not ask for;
    returns its target_prompt_logprobs (None if not asked)."""
    num_samples = int(body.get("num_samples") or 1)
    max_tokens = (body.get("sampling_params") or {}).get("max_tokens") or 256
    for name, positions, what in (("topk_prompt_logprobs", prompt_len, f"k x {prompt_len} prompt tokens"),
                                  ("topk_sample_logprobs", num_samples * max_tokens,
                                   f"k x num_samples {num_samples} x max_tokens {max_tokens}")):
        k = _count(body, name)
        if k > vocab_size:
            raise ServiceError(f"{name}={k} exceeds the model's vocabulary of {vocab_size} tokens; use 0 to "
                               f"{vocab_size}")
        _cells(name, k * positions, what)
    _cells("prompt_alt_tokens_k", _count(body, "prompt_alt_tokens_k") * (prompt_len - 1),
           f"k x {prompt_len - 1} prompt positions after the first")
    n = body.get("prompt_logprobs_last_n")
    if n is not None:
        if not body.get("prompt_logprobs"):
            raise ServiceError("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs (the SDK's "
                               "include_prompt_logprobs=True)")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= prompt_len - 1:
            raise ServiceError(f"prompt_logprobs_last_n must be 1 to len(prompt) - 1 = {prompt_len - 1}, got {n!r}")
    obj = body.get("target_prompt_logprobs")
    return target_of(obj, prompt_len, vocab_size) if obj is not None else None


def _count(body: Mapping[str, Any], name: str) -> int:
    k = body.get(name) or 0
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ServiceError(f"{name} must be an integer >= 0, got {k!r}")
    return k


def _ints(values: Any, what: str, low: int, high: int) -> np.ndarray:
    """A JSON list of integers in [low, high) as int64, checked before numpy sees it."""
    if not isinstance(values, list):
        raise ServiceError(f"{what} must be a list of integers")
    bad = next((i for i, v in enumerate(values) if type(v) is not int or not low <= v < high), None)
    if bad is not None:
        raise ServiceError(f"{what}: entry {bad}, {str(values[bad])[:20]}, is not an integer in [{low}, {high})")
    return np.asarray(values, np.int64)


def target_of(obj: Any, prompt_len: int, vocab_size: int) -> Target:
    """target_prompt_logprobs (a JSON TensorData of int64 ids, (len(prompt) - 1, K), dense or
    sparse CSR; -1 or an unlisted cell names nothing), bounded before anything is allocated."""
    what = "target_prompt_logprobs"
    if not isinstance(obj, Mapping) or not set(obj) <= _TENSOR_KEYS or "data" not in obj:
        raise ServiceError(f"{what} must be a TensorData {{data, dtype, shape[, sparse_crow_indices, "
                           f"sparse_col_indices]}}")
    if obj.get("dtype") != "int64":
        raise ServiceError(f"{what} must hold int64 token ids, got dtype {str(obj.get('dtype'))[:20]!r}")
    shape = obj.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(d) is int and d >= 0 for d in shape)):
        raise ServiceError(f"{what} needs a 2-D shape [len(prompt) - 1, K], got {str(shape)[:40]}")
    rows, cols = shape
    if rows != prompt_len - 1 or cols < 1:
        raise ServiceError(f"{what} must have shape [len(prompt) - 1 = {prompt_len - 1}, K >= 1], got {shape}")
    _cells(what, rows * cols, f"shape {shape}")
    crow, col = obj.get("sparse_crow_indices"), obj.get("sparse_col_indices")
    if (crow is None) != (col is None):
        raise ServiceError(f"{what}: sparse_crow_indices and sparse_col_indices go together")
    data = _ints(obj["data"], f"{what} data", -1, vocab_size)
    if crow is None:
        if data.size != rows * cols:
            raise ServiceError(f"{what}: {data.size} values do not fill shape {shape}")
        ids, csr = data.reshape(rows, cols), None
    else:
        ids, csr = _densify(data, _ints(crow, f"{what} sparse_crow_indices", 0, data.size + 1),
                            _ints(col, f"{what} sparse_col_indices", 0, cols), rows, cols, what)
    if not bool((ids >= 0).any()):
        raise ServiceError(f"{what} names no token id (every cell is -1); name at least one or leave it out")
    return Target(ids, csr)


def checked_target(body: Mapping[str, Any], prompt_len: int) -> Target | None:
    """The target_prompt_logprobs of a body `check` has passed (its ids' vocabulary bound included),
    or None."""
    obj = body.get("target_prompt_logprobs")
    return target_of(obj, prompt_len, 1 << 62) if obj is not None else None


def _densify(values: np.ndarray, crow: np.ndarray, col: np.ndarray, rows: int, cols: int, what: str):
    if len(crow) != rows + 1 or len(col) != len(values) or crow[0] != 0 or crow[-1] != len(values) \
            or np.any(np.diff(crow) < 0):
        raise ServiceError(f"{what}: sparse CSR indices must be {rows + 1} rising row pointers from 0 to the value "
                           f"count and one column per value")
    row = np.repeat(np.arange(rows), np.diff(crow))
    if np.unique(row * cols + col).size != len(values):
        raise ServiceError(f"{what}: a sparse cell is listed twice")
    ids = np.full((rows, cols), -1, np.int64)
    ids[row, col] = values
    return ids, (crow, col)


def encode(msg, res, target: Target | None) -> None:
    """The extras of an engine SampleResult into the SampleResponse message `msg`."""
    if res.topk_prompt_logprobs is not None:
        _topk(msg.topk_prompt_logprobs, res.topk_prompt_logprobs)
    for s, seq in zip(msg.sequences, res.sequences):
        if seq.topk_logprobs is not None:
            _topk(s.topk_sampled_logprobs, seq.topk_logprobs)
    if res.target_prompt_logprobs is not None:
        values = res.target_prompt_logprobs
        t = msg.target_prompt_logprobs
        t.dtype, t.shape[:] = 1, list(values.shape)
        if target is not None and target.csr is not None:
            crow, col = target.csr
            t.sparse_csr.values = np.ascontiguousarray(values[np.repeat(np.arange(len(crow) - 1), np.diff(crow)), col],
                                                       np.float32).tobytes()
            t.sparse_csr.crow_indices = crow.astype(np.int64).tobytes()
            t.sparse_csr.col_indices = col.astype(np.int64).tobytes()
        else:
            t.dense = np.ascontiguousarray(values, np.float32).tobytes()
    if res.prompt_alt_tokens is not None:
        alt = res.prompt_alt_tokens
        msg.prompt_alt_tokens.SetInParent()  # present even when the prompt has one token (0 rows)
        _dense(msg.prompt_alt_tokens.tokens, alt.token_ids, np.int64, 2)
        _dense(msg.prompt_alt_tokens.logprobs, alt.logprobs, np.float32, 1)


def _dense(t, values: np.ndarray, dtype, code: int) -> None:
    t.dense, t.dtype, t.shape[:] = np.ascontiguousarray(values, dtype).tobytes(), code, list(values.shape)


def _topk(t, top) -> None:
    """TopkLogprobs: (N, k) int32 ids and float32 logprobs; an unscored row holds the SDK's mask."""
    ids, lps = np.asarray(top.token_ids), np.asarray(top.logprobs, np.float32)
    unscored = np.isnan(lps)
    t.token_ids = np.where(unscored, MASK_TOKEN, ids).astype(np.int32).tobytes()
    t.logprobs = np.where(unscored, np.float32(MASK_LOGPROB), lps).astype(np.float32).tobytes()
    t.length, t.k = ids.shape
