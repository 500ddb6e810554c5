"""DRO: policy gradient with a quadratic penalty keeping lp near the sampler's q.

    loss_t = -(lp_t * A_t - 0.5 * beta * (lp_t - q_t)**2)

The penalty is a cheap stand-in for a KL trust region: its gradient beta * (lp_t - q_t) pulls the
learner back towards the sampler. `beta` defaults to 0.05 (a small penalty, chosen so that for
|A| ~ 1 the policy-gradient term dominates until lp drifts ~20 nats from q). Summed over tokens,
not averaged.
"""

from __future__ import annotations

from typing import Mapping

import torch

from lockstep.losses.types import LossInputs, metric_mean

CONFIG_KEYS: Mapping[str, float] = {"beta": 0.05}
"""Allowed config keys and their defaults."""
INPUTS: tuple[str, ...] = ("target_tokens", "logprobs", "advantages")
"""The loss_fn_inputs every datum must carry."""


def dro_loss(inputs: LossInputs, config: Mapping[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
    """Elementwise `-(lp*A - 0.5*beta*(lp - q)**2)`; the objective is its sum over tokens."""
    beta = config.get("beta", CONFIG_KEYS["beta"])
    diff_T = inputs.logprobs_T - inputs.sampler_logprobs_T
    loss_T = -(inputs.logprobs_T * inputs.advantages_T - 0.5 * beta * diff_T**2)
    return loss_T, {"penalty:mean": metric_mean(0.5 * beta * diff_T**2)}
