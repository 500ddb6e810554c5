"""Training-inference mismatch corrections, applied around any loss.

The sampler and the trainer can disagree on a token's logprob even with identical weights (different
kernels, precisions, batching). Let prox_t = sg(lp_t), the trainer's own logprob under the current
weights, and q_t the sampler's. The behaviour ratio

    w_t = exp(prox_t - q_t)

re-weights each token from the sampler's distribution to the trainer's. Two corrections:

- TIS (truncated importance sampling), config `tis_cap` > 0:   w_t = min(w_t, tis_cap)
  bounds the variance a few badly mismatched tokens can inject.
- MIS (masked importance sampling), config `mis_low` / `mis_high`:
      w_t = w_t * 1[mis_low <= w_t <= mis_high]
  drops tokens whose mismatch is too large to trust; they contribute exactly 0 loss. Either bound
  may be given alone (the other defaults to 0 / +inf). The mask is decided on the raw ratio, before
  any TIS cap, so a cap below mis_high cannot hide out-of-band tokens.

The inner loss then runs with its anchor moved to the trainer: sampler_logprobs_T := prox_T, so any
ratio inside it is exp(lp - sg(lp)) (value 1, gradient dlp), and its elementwise loss is multiplied
by sg(w_t). For importance_sampling this gives gradient -w_t * A_t * dlp_t. Summed over tokens, not
averaged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import torch

from lockstep.losses.types import LossError, LossFn, LossInputs, metric_max, metric_mean

CORRECTION_KEYS = frozenset({"tis_cap", "mis_low", "mis_high"})
"""Config keys consumed here and stripped before the inner loss sees the config."""


def _validate(config: Mapping[str, float]) -> None:
    if "tis_cap" in config and not config["tis_cap"] > 0:
        raise LossError(
            f"tis_cap must be a number > 0 (the largest importance weight kept), got {config['tis_cap']!r}"
        )
    low = config.get("mis_low", 0.0)
    high = config.get("mis_high", math.inf)
    if ("mis_low" in config or "mis_high" in config) and not low < high:
        raise LossError(
            f"mis_low must be < mis_high (the band of importance weights kept), "
            f"got mis_low={low!r}, mis_high={high!r}"
        )


def _behaviour_weights(
    prox_T: torch.Tensor, q_T: torch.Tensor, config: Mapping[str, float]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The detached per-token weight w_T, the MIS keep mask keep_T, and metrics describing them."""
    raw_T = torch.exp(prox_T - q_T)
    mismatch_T = (prox_T - q_T).abs()
    metrics = {"mismatch_abs:max": metric_max(mismatch_T), "mismatch_abs:mean": metric_mean(mismatch_T)}
    keep_T = torch.ones_like(raw_T, dtype=torch.bool)
    if "mis_low" in config or "mis_high" in config:
        keep_T = (raw_T >= config.get("mis_low", 0.0)) & (raw_T <= config.get("mis_high", math.inf))
        metrics["mis_masked_fraction:mean"] = metric_mean((~keep_T).float())
    w_T = torch.where(keep_T, raw_T, torch.zeros_like(raw_T))
    if "tis_cap" in config:
        cap = config["tis_cap"]
        # Counts tokens whose applied weight the cap lowered (MIS-masked tokens are already 0).
        metrics["tis_clipped_fraction:mean"] = metric_mean((w_T > cap).float())
        w_T = torch.clamp(w_T, max=cap)
        metrics["tis_weight:mean"] = metric_mean(w_T)
    return w_T, keep_T, metrics


def apply_corrections(
    loss_fn: LossFn, inputs: LossInputs, config: Mapping[str, float]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run `loss_fn` with TIS/MIS corrections when the config asks for them, else unchanged.

    Returns (elementwise_loss_T, metrics); the inner loss's metrics are merged with the correction
    metrics. The correction keys are stripped from the config passed to `loss_fn`.
    """
    if CORRECTION_KEYS.isdisjoint(config):
        return loss_fn(inputs, config)
    _validate(config)
    inner_config = {k: v for k, v in config.items() if k not in CORRECTION_KEYS}
    prox_T = inputs.logprobs_T.detach()
    w_T, keep_T, metrics = _behaviour_weights(prox_T, inputs.sampler_logprobs_T.detach(), config)
    inner_loss_T, inner_metrics = loss_fn(dataclasses.replace(inputs, sampler_logprobs_T=prox_T), inner_config)
    # torch.where, not a multiply by 0, so a masked token is exactly 0 even if its inner loss is inf.
    loss_T = torch.where(keep_T, inner_loss_T * w_T.to(inner_loss_T.dtype), torch.zeros_like(inner_loss_T))
    return loss_T, {**inner_metrics, **metrics}
