"""Weighted negative log-likelihood (supervised fine-tuning).

    loss_t = -lp_t * w_t

Summed over tokens, not averaged: to get a per-token mean, put 1/T into the weights. Weights of 0
drop tokens (e.g. the prompt) from the objective.
"""

from __future__ import annotations

from typing import Mapping

import torch

from lockstep.losses.types import LossInputs

CONFIG_KEYS: Mapping[str, float] = {}
"""cross_entropy takes no config."""
INPUTS: tuple[str, ...] = ("target_tokens",)
"""cross_entropy needs only targets: weights default to ones."""


def cross_entropy_loss(inputs: LossInputs, config: Mapping[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
    """Elementwise `-lp * weights`; the objective is its sum over tokens."""
    loss_T = -inputs.logprobs_T * inputs.weights_T
    return loss_T, {}
