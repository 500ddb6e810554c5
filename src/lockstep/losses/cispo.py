"""CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio.

    ratio_t = exp(lp_t - q_t)
    loss_t  = -sg(clip(ratio_t, lo_t, hi_t)) * lp_t * A_t        (sg = detach)

Unlike PPO, clipping never zeroes a token's gradient: it only bounds the weight, so the gradient is
exactly -clip(ratio_t) * A_t * dlp_t. Clip keys and defaults as in PPO (`clip_low_threshold` 0.8,
`clip_high_threshold` 1.2, per-token overrides win). Summed over tokens, not averaged.
"""

from __future__ import annotations

from typing import Mapping

import torch

from lockstep.losses.types import LossInputs, metric_mean

CONFIG_KEYS: Mapping[str, float] = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
"""Allowed config keys and their defaults."""
INPUTS: tuple[str, ...] = ("target_tokens", "logprobs", "advantages")
"""The loss_fn_inputs every datum must carry; per-token clip thresholds are optional."""


def cispo_loss(inputs: LossInputs, config: Mapping[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
    """Elementwise `-sg(clip(ratio, lo, hi)) * lp * A`; the objective is its sum over tokens.

    Metric `clip_fraction:mean`: fraction of tokens whose ratio lay outside [lo, hi].
    """
    lo_T, hi_T = inputs.ratio_bounds(
        config.get("clip_low_threshold", CONFIG_KEYS["clip_low_threshold"]),
        config.get("clip_high_threshold", CONFIG_KEYS["clip_high_threshold"]),
    )
    ratio_T = torch.exp(inputs.logprobs_T - inputs.sampler_logprobs_T).detach()
    weight_T = torch.clamp(ratio_T, lo_T, hi_T)
    loss_T = -weight_T * inputs.logprobs_T * inputs.advantages_T
    return loss_T, {"clip_fraction:mean": metric_mean(((ratio_T < lo_T) | (ratio_T > hi_T)).float())}
