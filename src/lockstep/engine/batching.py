"""Turn Tinker-style datums into padded tensors, validating everything before any compute.

Validation happens here, up front, so that a bad batch raises before gradients or optimizer
state are touched ("writes no partial state").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from lockstep.engine.types import Datum, EngineError

FLOAT_KEYS = ("weights", "logprobs", "advantages", "sequence_ratio_mask", "clip_low_threshold", "clip_high_threshold")
KNOWN_KEYS = ("target_tokens", *FLOAT_KEYS)


@dataclass(frozen=True)
class Batch:
    """B datums right-padded to T tokens."""

    tokens_BT: torch.Tensor  # int64 inputs
    targets_BT: torch.Tensor  # int64 targets (0 where padded)
    valid_BT: torch.Tensor  # bool: a real position
    lengths: tuple[int, ...]
    floats: dict[str, torch.Tensor]  # FLOAT_KEYS present in any datum, flattened over valid tokens
    """Per-token float inputs concatenated over datums (shape (sum(lengths),))."""


def _array(datum_idx: int, key: str, value, n: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.shape != (n,):
        raise EngineError(
            f"datum {datum_idx}: loss_fn_inputs[{key!r}] has shape {arr.shape}, expected ({n},) "
            f"to match model_input's {n} tokens"
        )
    return arr


def _check_datum(i: int, d: Datum, vocab_size: int) -> None:
    n = len(d.model_input)
    if n == 0:
        raise EngineError(f"datum {i}: model_input is empty")
    bad = [t for t in d.model_input if not (0 <= int(t) < vocab_size)]
    if bad:
        raise EngineError(f"datum {i}: model_input holds token ids outside [0, {vocab_size}): {bad[:5]}")
    if "target_tokens" not in d.loss_fn_inputs:
        raise EngineError(f"datum {i}: loss_fn_inputs needs 'target_tokens' (int64, shape ({n},))")
    unknown = set(d.loss_fn_inputs) - set(KNOWN_KEYS)
    if unknown:
        raise EngineError(f"datum {i}: unknown loss_fn_inputs keys {sorted(unknown)}; known: {list(KNOWN_KEYS)}")
    tgt = _array(i, "target_tokens", d.loss_fn_inputs["target_tokens"], n)
    if not np.issubdtype(tgt.dtype, np.integer):
        raise EngineError(f"datum {i}: target_tokens must be integers, got dtype {tgt.dtype}")
    if tgt.size and (tgt.min() < 0 or tgt.max() >= vocab_size):
        raise EngineError(f"datum {i}: target_tokens hold ids outside [0, {vocab_size})")
    for key in FLOAT_KEYS:
        if key in d.loss_fn_inputs:
            arr = _array(i, key, d.loss_fn_inputs[key], n)
            if not np.all(np.isfinite(arr.astype(np.float64))):
                raise EngineError(f"datum {i}: loss_fn_inputs[{key!r}] contains NaN or inf")


def make_batch(data: Sequence[Datum], vocab_size: int) -> Batch:
    if not data:
        raise EngineError("data is empty; pass at least one datum")
    for i, d in enumerate(data):
        if not isinstance(d, Datum):
            raise EngineError(f"datum {i} is a {type(d).__name__}, expected lockstep Datum")
        _check_datum(i, d, vocab_size)
    lengths = tuple(len(d.model_input) for d in data)
    B, T = len(data), max(lengths)
    tokens = torch.zeros(B, T, dtype=torch.long)
    targets = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for i, d in enumerate(data):
        n = lengths[i]
        tokens[i, :n] = torch.tensor(d.model_input, dtype=torch.long)
        targets[i, :n] = torch.from_numpy(np.asarray(d.loss_fn_inputs["target_tokens"], dtype=np.int64))
        valid[i, :n] = True
    floats = {}
    for key in FLOAT_KEYS:
        if any(key in d.loss_fn_inputs for d in data):
            default = 1.0 if key in ("weights", "sequence_ratio_mask") else 0.0
            parts = [
                np.asarray(d.loss_fn_inputs[key], np.float32) if key in d.loss_fn_inputs
                else np.full(lengths[i], default, np.float32)
                for i, d in enumerate(data)
            ]
            floats[key] = torch.as_tensor(np.concatenate(parts))  # on the scope's device (a GPU trainer)
    return Batch(tokens, targets, valid, lengths, floats)
