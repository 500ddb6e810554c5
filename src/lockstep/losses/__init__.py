"""Loss registry and the single entry point, `compute_loss`.

Every loss is a pure function `(LossInputs, config) -> (elementwise_loss_T, metrics)` registered
under a Tinker loss name together with the config keys it accepts (and their defaults). The core
here never branches on a loss name: validation, corrections and dispatch are the same for all.
The objective is `elementwise_loss_T.sum()` (summed over tokens, no normalisation).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Mapping

import torch

from lockstep.config.types import (LOSS_CONFIG_RANGES, LOSS_CORRECTION_KEYS, LOSS_INPUTS, UNSUPPORTED_LOSSES,
                                   missing_loss_input)
from lockstep.config.types import LOSSES as BUILTIN_LOSSES
from lockstep.losses import cispo, cross_entropy, dro, gspo, importance_sampling, ppo
from lockstep.losses.corrections import CORRECTION_KEYS, apply_corrections
from lockstep.losses.types import LossError, LossFn, LossInputs, is_metric_key

__all__ = [
    "LOSSES",
    "LOSS_CONFIG_KEYS",
    "LOSS_REQUIRED_INPUTS",
    "LossError",
    "LossFn",
    "LossInputs",
    "apply_corrections",
    "compute_loss",
    "get_loss",
    "missing_input",
    "register_loss",
]

LOSSES: dict[str, LossFn] = {}
"""Registered losses by name."""

LOSS_CONFIG_KEYS: dict[str, Mapping[str, float] | None] = {}
"""Per loss, its allowed config keys with defaults; None means the loss accepts any keys."""

LOSS_REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {}
"""Per loss, the loss_fn_inputs keys every datum must carry (the others get LossInputs' defaults)."""

_UNSUPPORTED = UNSUPPORTED_LOSSES
"""Names a user may reasonably ask for that are deliberately not implemented, with the reason
(listed with the built-in names in the torch-free config contract)."""

# Per-token tensors whose values come from the user's datums, with the name the user knows them by.
_USER_FIELDS = (
    ("advantages_T", "advantages"),
    ("weights_T", "weights"),
    ("sampler_logprobs_T", "logprobs (sampler logprobs)"),
    ("mask_T", "sequence_ratio_mask"),
    ("clip_low_T", "clip_low_threshold"),
    ("clip_high_T", "clip_high_threshold"),
)


def register_loss(
    name: str, fn: LossFn, *, config_keys: Mapping[str, float] | None = None,
    inputs: tuple[str, ...] = ("target_tokens",), overwrite: bool = False
) -> None:
    """Register `fn` under `name`.

    `config_keys` maps each accepted config key to its default; None accepts any keys (for custom
    losses that validate their own config). `inputs`: the loss_fn_inputs keys every datum must
    carry; a missing one is refused rather than given LossInputs' default (zeros for logprobs and
    advantages). Raises LossError if the name is taken, unless `overwrite=True`.
    """
    if name in LOSSES and not overwrite:
        raise LossError(f"loss {name!r} is already registered; pass overwrite=True to replace it")
    LOSSES[name] = fn
    LOSS_CONFIG_KEYS[name] = dict(config_keys) if config_keys is not None else None
    LOSS_REQUIRED_INPUTS[name] = tuple(inputs)


def _supported() -> str:
    return ", ".join(LOSSES)


def get_loss(name: str) -> LossFn:
    """The loss registered as `name`; LossError listing the supported names otherwise."""
    if name in LOSSES:
        return LOSSES[name]
    if name in _UNSUPPORTED:
        raise LossError(f"loss {name!r} is not supported: {_UNSUPPORTED[name]}; supported: {_supported()}")
    raise LossError(f"unknown loss {name!r}; supported: {_supported()}")


def _validate_config(name: str, config: Mapping[str, float]) -> None:
    # The API checked these too; the worker does not trust that (a stored body, a direct caller).
    builtin = name in BUILTIN_LOSSES and LOSS_CONFIG_KEYS[name] is not None
    for key, value in config.items():
        bounds = LOSS_CONFIG_RANGES.get(key) if builtin or key in CORRECTION_KEYS else None
        if bounds is not None and not bounds.holds(value):
            raise LossError(f"loss_fn_config[{key!r}] must be a number in {bounds}, got {value!r}")
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
            raise LossError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
    allowed = LOSS_CONFIG_KEYS[name]
    if allowed is None:
        return
    unknown = sorted(set(config) - set(allowed) - CORRECTION_KEYS)
    if unknown:
        keys = ", ".join(sorted(allowed) + sorted(CORRECTION_KEYS))
        raise LossError(f"loss {name!r} got unknown config key(s) {', '.join(map(repr, unknown))}; allowed: {keys}")


def missing_input(name: str, config: Mapping[str, float] | None, data_keys) -> str | None:
    """Which input the first datum lacking one lacks, for loss `name` with `config` (a message
    naming the datum and the key), or None. data_keys: each datum's loss_fn_inputs keys. Raises
    LossError for an unknown loss."""
    get_loss(name)
    return missing_loss_input(name, LOSS_REQUIRED_INPUTS[name], dict(config or {}), data_keys)


def _validate_inputs(inputs: LossInputs) -> None:
    for attr, label in _USER_FIELDS:
        t = getattr(inputs, attr)
        if t is None:
            continue
        bad_T = ~torch.isfinite(t)
        if bool(bad_T.any()):
            i = int(bad_T.nonzero()[0, 0])
            raise LossError(f"loss input {label!r} must be finite, but token {i} is {t[i].item()}")
    seg_T = inputs.segment_T
    if seg_T.numel() and (int(seg_T.min()) < 0 or int(seg_T.max()) >= inputs.num_segments):
        raise LossError(
            f"segment_T must lie in [0, {inputs.num_segments}), got range [{int(seg_T.min())}, {int(seg_T.max())}]"
        )


def _check_output(name: str, inputs: LossInputs, loss_T: torch.Tensor, metrics: Mapping[str, float]) -> None:
    # Custom losses can break the contract, so these are LossErrors rather than asserts.
    if not isinstance(loss_T, torch.Tensor) or loss_T.shape != inputs.logprobs_T.shape:
        shape = tuple(loss_T.shape) if isinstance(loss_T, torch.Tensor) else type(loss_T).__name__
        raise LossError(f"loss {name!r} must return an elementwise loss of shape ({inputs.num_tokens},), got {shape}")
    bad = [k for k in metrics if not is_metric_key(k)]
    if bad:
        raise LossError(f"loss {name!r} returned metric key(s) {bad}; keys must look like 'name:mean|sum|min|max'")


def compute_loss(
    name: str, inputs: LossInputs, config: Mapping[str, float] | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Validate, apply TIS/MIS corrections if configured, and run the loss `name`.

    Returns (elementwise_loss_T, metrics); the objective to backpropagate is
    `elementwise_loss_T.sum()`. Raises LossError for an unknown loss, a bad config or non-finite
    user inputs.
    """
    fn = get_loss(name)
    config = dict(config or {})
    _validate_config(name, config)
    _validate_inputs(inputs)
    loss_T, metrics = apply_corrections(fn, inputs, config)
    _check_output(name, inputs, loss_T, metrics)
    return loss_T, metrics


register_loss("cross_entropy", cross_entropy.cross_entropy_loss, config_keys=cross_entropy.CONFIG_KEYS,
              inputs=cross_entropy.INPUTS)
register_loss("importance_sampling", importance_sampling.importance_sampling_loss,
              config_keys=importance_sampling.CONFIG_KEYS, inputs=importance_sampling.INPUTS)
register_loss("ppo", ppo.ppo_loss, config_keys=ppo.CONFIG_KEYS, inputs=ppo.INPUTS)
register_loss("cispo", cispo.cispo_loss, config_keys=cispo.CONFIG_KEYS, inputs=cispo.INPUTS)
register_loss("dro", dro.dro_loss, config_keys=dro.CONFIG_KEYS, inputs=dro.INPUTS)
register_loss("gspo", gspo.gspo_loss, config_keys=gspo.CONFIG_KEYS, inputs=gspo.INPUTS)
# The torch-free list of built-in names (config, the service's API) must be exactly this registry.
assert {k: tuple(v) for k, v in LOSS_CONFIG_KEYS.items()} == BUILTIN_LOSSES, "update config.types.LOSSES"
assert set(CORRECTION_KEYS) == set(LOSS_CORRECTION_KEYS), "update config.types.LOSS_CORRECTION_KEYS"
assert LOSS_REQUIRED_INPUTS == LOSS_INPUTS, "update config.types.LOSS_INPUTS"
