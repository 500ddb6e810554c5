"""Off-policy REINFORCE with an importance ratio against the sampler.

    ratio_t = exp(lp_t - q_t)
    loss_t  = -ratio_t * A_t

The ratio corrects for the samples having been drawn from q rather than the learner p; its
gradient is -ratio_t * A_t * dlp_t. Summed over tokens, not averaged.
"""

from __future__ import annotations

from typing import Mapping

import torch

from lockstep.losses.types import LossInputs, metric_max, metric_mean

CONFIG_KEYS: Mapping[str, float] = {}
"""importance_sampling takes no config."""
INPUTS: tuple[str, ...] = ("target_tokens", "logprobs", "advantages")
"""The loss_fn_inputs every datum must carry (no documented default)."""


def importance_sampling_loss(
    inputs: LossInputs, config: Mapping[str, float]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Elementwise `-exp(lp - q) * A`; the objective is its sum over tokens."""
    ratio_T = torch.exp(inputs.logprobs_T - inputs.sampler_logprobs_T)
    loss_T = -ratio_T * inputs.advantages_T
    metrics = {"importance_ratio:mean": metric_mean(ratio_T), "importance_ratio:max": metric_max(ratio_T)}
    return loss_T, metrics
