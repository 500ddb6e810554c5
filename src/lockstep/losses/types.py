"""The loss contract: what every loss function takes and returns.

A batch of datums is flattened to T tokens; every per-token tensor has shape (T,) and `segment_T`
says which datum each token belongs to. A loss returns an *elementwise* loss of shape (T,) and a
dict of scalar metrics. The training objective is `elementwise_loss_T.sum()`: as in Tinker, every
loss is SUMMED over tokens with no normalisation, so callers control the scale through advantages
and weights (e.g. divide advantages by the token count to get a per-token mean).

Metric keys look like `name:reduction` with reduction one of mean/sum/min/max, so that a caller
aggregating metrics over several forward_backward calls knows how to combine them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

METRIC_REDUCTIONS = ("mean", "sum", "min", "max")
_METRIC_KEY_RE = re.compile(r"^[A-Za-z0-9_./-]+:(mean|sum|min|max)$")


class LossError(ValueError):
    """A user error in a loss request: the message says what is wrong and what is expected."""


@dataclass(frozen=True)
class LossInputs:
    """Per-token tensors of a batch of datums, flattened to T tokens (all shape (T,))."""

    logprobs_T: torch.Tensor
    """Learner log p(target); requires grad in training."""
    sampler_logprobs_T: torch.Tensor
    """q: the sampler's logprobs (zeros if not given)."""
    advantages_T: torch.Tensor
    """A (zeros if not given)."""
    weights_T: torch.Tensor
    """cross_entropy weights (ones if not given)."""
    mask_T: torch.Tensor
    """gspo sequence_ratio_mask (ones if not given), float."""
    segment_T: torch.Tensor
    """int64 datum index of each token (0..num_segments-1)."""
    num_segments: int
    clip_low_T: torch.Tensor | None = None
    """Optional per-token ratio floor (Tinker loss_fn_inputs key clip_low_threshold)."""
    clip_high_T: torch.Tensor | None = None
    """Optional per-token ratio ceiling (Tinker loss_fn_inputs key clip_high_threshold)."""

    def __post_init__(self) -> None:
        # Cheap structural checks only (no device syncs); value checks live in compute_loss.
        if self.logprobs_T.ndim != 1:
            raise LossError(f"logprobs must be 1-D (T,), got shape {tuple(self.logprobs_T.shape)}")
        (T,) = self.logprobs_T.shape
        for name, t in self._tensor_fields():
            if t.shape != (T,):
                raise LossError(f"{name} must have shape ({T},) like logprobs, got {tuple(t.shape)}")
        if self.segment_T.dtype != torch.int64:
            raise LossError(f"segment_T must be int64, got {self.segment_T.dtype}")
        if not self.mask_T.is_floating_point():
            raise LossError(f"mask_T must be a float tensor, got {self.mask_T.dtype}")
        if isinstance(self.num_segments, bool) or not isinstance(self.num_segments, int):
            raise LossError(f"num_segments must be an int, got {self.num_segments!r}")
        if self.num_segments < (1 if T > 0 else 0):
            raise LossError(f"num_segments must be >= 1 when there are tokens, got {self.num_segments}")

    def _tensor_fields(self) -> list[tuple[str, torch.Tensor]]:
        fields = [
            ("sampler_logprobs_T", self.sampler_logprobs_T),
            ("advantages_T", self.advantages_T),
            ("weights_T", self.weights_T),
            ("mask_T", self.mask_T),
            ("segment_T", self.segment_T),
            ("clip_low_T", self.clip_low_T),
            ("clip_high_T", self.clip_high_T),
        ]
        return [(n, t) for n, t in fields if t is not None]

    @property
    def num_tokens(self) -> int:
        return self.logprobs_T.shape[0]

    @classmethod
    def create(
        cls,
        logprobs_T: torch.Tensor,
        *,
        sampler_logprobs_T: torch.Tensor | None = None,
        advantages_T: torch.Tensor | None = None,
        weights_T: torch.Tensor | None = None,
        mask_T: torch.Tensor | None = None,
        segment_T: torch.Tensor | None = None,
        num_segments: int | None = None,
        clip_low_T: torch.Tensor | None = None,
        clip_high_T: torch.Tensor | None = None,
    ) -> LossInputs:
        """Build inputs with the documented defaults; without `segment_T` all tokens are one datum."""
        lp = logprobs_T
        T = lp.shape[0] if lp.ndim == 1 else -1
        like = dict(dtype=lp.dtype, device=lp.device)
        if segment_T is None:
            segment_T = torch.zeros(max(T, 0), dtype=torch.int64, device=lp.device)
        if num_segments is None:
            num_segments = int(segment_T.max().item()) + 1 if segment_T.numel() else 0
        return cls(
            logprobs_T=lp,
            sampler_logprobs_T=sampler_logprobs_T if sampler_logprobs_T is not None else torch.zeros(max(T, 0), **like),
            advantages_T=advantages_T if advantages_T is not None else torch.zeros(max(T, 0), **like),
            weights_T=weights_T if weights_T is not None else torch.ones(max(T, 0), **like),
            mask_T=mask_T if mask_T is not None else torch.ones(max(T, 0), **like),
            segment_T=segment_T,
            num_segments=num_segments,
            clip_low_T=clip_low_T,
            clip_high_T=clip_high_T,
        )

    def ratio_bounds(self, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token clip bounds (lo_T, hi_T): the config scalars, overridden by clip_low_T/clip_high_T.

        Raises LossError when some token's floor exceeds its ceiling, since clipping would then be
        ill-defined (torch.clamp silently returns the ceiling).
        """
        like = self.logprobs_T.detach()
        lo_T = self.clip_low_T.to(like) if self.clip_low_T is not None else torch.full_like(like, low)
        hi_T = self.clip_high_T.to(like) if self.clip_high_T is not None else torch.full_like(like, high)
        bad_T = lo_T > hi_T
        if bool(bad_T.any()):
            i = int(bad_T.nonzero()[0, 0])
            raise LossError(
                f"clip floor must not exceed clip ceiling, but token {i} has "
                f"clip_low_threshold={lo_T[i].item()} > clip_high_threshold={hi_T[i].item()}"
            )
        return lo_T, hi_T


LossFn = Callable[[LossInputs, Mapping[str, float]], tuple[torch.Tensor, dict[str, float]]]
"""A loss takes inputs and a config dict and returns (elementwise_loss_T, metrics).

The objective is `elementwise_loss_T.sum()`; metric keys are `name:reduction`.
"""


def is_metric_key(key: str) -> bool:
    """True for keys shaped `name:reduction` with reduction in mean/sum/min/max."""
    return bool(_METRIC_KEY_RE.match(key))


def segment_sum(x_T: torch.Tensor, segment_T: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Per-segment sums of x_T, shape (num_segments,), in one fixed order on every device: each
    segment's terms go into a row of a zero-padded (segments, longest segment) table, summed row
    by row. Not index_add_, which on CUDA adds with atomics in no fixed order, so the same batch
    could give other bits from one run to the next (and a data-parallel step other bits than one
    trainer)."""
    if x_T.numel() == 0:
        return x_T.new_zeros(num_segments)
    segment_T = segment_T.to(x_T.device)
    order_T = torch.argsort(segment_T, stable=True)  # each segment's tokens together, in token order
    sorted_T = segment_T[order_T]
    counts_S = torch.bincount(segment_T, minlength=num_segments)  # integer counts: exact on any device
    starts_S = torch.cumsum(counts_S, 0) - counts_S
    column_T = torch.arange(len(sorted_T), device=x_T.device) - starts_S[sorted_T]
    table = x_T.new_zeros(num_segments, int(counts_S.max()))
    table[sorted_T, column_T] = x_T[order_T]  # every (segment, column) written once
    return table.sum(1)


def metric_mean(x_T: torch.Tensor) -> float:
    """Mean as a Python float; 0.0 for an empty batch (rather than NaN)."""
    return float(x_T.detach().float().mean().item()) if x_T.numel() else 0.0


def metric_max(x_T: torch.Tensor) -> float:
    """Max as a Python float; 0.0 for an empty batch (torch.max would raise)."""
    return float(x_T.detach().float().max().item()) if x_T.numel() else 0.0
