"""PPO's clipped surrogate, per token.

    ratio_t = exp(lp_t - q_t)
    loss_t  = -min(ratio_t * A_t, clip(ratio_t, lo_t, hi_t) * A_t)

lo/hi come from config `clip_low_threshold` (default 0.8) and `clip_high_threshold` (default 1.2),
overridden per token by `clip_low_T` / `clip_high_T` when the datum gives them. The min makes the
objective pessimistic: once the ratio has moved past the band in the direction the advantage
favours, the gradient is zero. Summed over tokens, not averaged.
"""

from __future__ import annotations

from typing import Mapping

import torch

from lockstep.losses.types import LossInputs, metric_mean

CONFIG_KEYS: Mapping[str, float] = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
"""Allowed config keys and their defaults."""
INPUTS: tuple[str, ...] = ("target_tokens", "logprobs", "advantages")
"""The loss_fn_inputs every datum must carry; per-token clip thresholds are optional."""


def ppo_loss(inputs: LossInputs, config: Mapping[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
    """Elementwise `-min(ratio*A, clip(ratio, lo, hi)*A)`; the objective is its sum over tokens.

    Metric `clip_fraction:mean`: fraction of all tokens where the clipped branch was strictly
    smaller, i.e. where clipping removed the gradient.
    """
    lo_T, hi_T = inputs.ratio_bounds(
        config.get("clip_low_threshold", CONFIG_KEYS["clip_low_threshold"]),
        config.get("clip_high_threshold", CONFIG_KEYS["clip_high_threshold"]),
    )
    ratio_T = torch.exp(inputs.logprobs_T - inputs.sampler_logprobs_T)
    unclipped_T = ratio_T * inputs.advantages_T
    clipped_T = torch.clamp(ratio_T, lo_T, hi_T) * inputs.advantages_T
    loss_T = -torch.minimum(unclipped_T, clipped_T)
    return loss_T, {"clip_fraction:mean": metric_mean((clipped_T < unclipped_T).float())}
