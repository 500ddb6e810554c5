"""GSPO-token: PPO clipping on a sequence-level importance ratio, with per-token gradients.

For each datum (segment) g, over its masked tokens (mask = sequence_ratio_mask):

    s_g   = exp( sum_t m_t * (sg(lp_t) - q_t) / sum_t m_t )     (s_g = 1 if the datum has no masked tokens)
    s_t   = sg(s_g[segment_t]) * exp(lp_t - sg(lp_t))           (value s_g, gradient s_g * dlp_t)
    loss_t = -min(s_t * A_t, clip(s_t, lo_t, hi_t) * A_t)

The geometric-mean ratio s_g is what gets clipped, so a datum is kept or clipped as a whole, which
is less noisy than per-token ratios over long sequences. The mask only chooses which tokens enter
s_g; every token still gets its own loss term (tokens with A_t = 0 contribute nothing).

Clip keys as in PPO, with the same defaults (`clip_low_threshold` 0.8, `clip_high_threshold` 1.2;
per-token overrides win). Note that the GSPO paper uses a far narrower band (about 1 -/+ 3e-4)
because a sequence-level ratio moves much less than a token-level one; pass it in the config.
Summed over tokens, not averaged.
"""

from __future__ import annotations

from typing import Mapping

import torch

from lockstep.losses.types import LossInputs, metric_mean, segment_sum

CONFIG_KEYS: Mapping[str, float] = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
"""Allowed config keys and their defaults."""
INPUTS: tuple[str, ...] = ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask")
"""The loss_fn_inputs every datum must carry: without the mask the prompt (logprobs padded
with 0) would enter the sequence ratio."""


def sequence_log_ratios(inputs: LossInputs) -> torch.Tensor:
    """Per-datum masked mean of (sg(lp) - q), shape (num_segments,); 0 for datums with no masked tokens.

    Accumulated in at least float32 so long sequences in low precision keep their sum.
    """
    acc = torch.promote_types(inputs.logprobs_T.dtype, torch.float32)
    mask_T = inputs.mask_T.to(acc)
    diff_T = (inputs.logprobs_T.detach() - inputs.sampler_logprobs_T).to(acc)
    num_S = segment_sum(mask_T * diff_T, inputs.segment_T, inputs.num_segments)
    den_S = segment_sum(mask_T, inputs.segment_T, inputs.num_segments)
    empty_S = den_S == 0
    return torch.where(empty_S, torch.zeros_like(num_S), num_S / torch.where(empty_S, torch.ones_like(den_S), den_S))


def gspo_loss(inputs: LossInputs, config: Mapping[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
    """Elementwise `-min(s_t*A, clip(s_t, lo, hi)*A)`; the objective is its sum over tokens.

    Metrics: `clip_fraction:mean` (tokens where the clipped branch was strictly smaller) and
    `sequence_ratio:mean` (mean of s_g over datums).
    """
    lo_T, hi_T = inputs.ratio_bounds(
        config.get("clip_low_threshold", CONFIG_KEYS["clip_low_threshold"]),
        config.get("clip_high_threshold", CONFIG_KEYS["clip_high_threshold"]),
    )
    lp_T = inputs.logprobs_T
    seq_ratio_S = torch.exp(sequence_log_ratios(inputs)).to(lp_T.dtype)
    s_T = seq_ratio_S[inputs.segment_T] * torch.exp(lp_T - lp_T.detach())
    unclipped_T = s_T * inputs.advantages_T
    clipped_T = torch.clamp(s_T, lo_T, hi_T) * inputs.advantages_T
    loss_T = -torch.minimum(unclipped_T, clipped_T)
    metrics = {
        "clip_fraction:mean": metric_mean((clipped_T < unclipped_T).float()),
        "sequence_ratio:mean": metric_mean(seq_ratio_S),
    }
    return loss_T, metrics
