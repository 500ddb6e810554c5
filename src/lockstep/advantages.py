"""Group-relative advantage estimators (torch-free, so client code can use them without torch).

Each estimator maps the rewards of one group of G samples of the same prompt, shape (G,), to one
advantage per sample, shape (G,). Using the group as its own baseline removes the need for a value
model: a sample is good only relative to its siblings.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from numpy.typing import ArrayLike

AdvantageEstimator = Callable[[ArrayLike], np.ndarray]


class AdvantageError(ValueError):
    """A user error in advantage estimation: the message says what is wrong and what is expected."""


def _as_rewards(rewards_G: ArrayLike, min_size: int) -> np.ndarray:
    """Rewards as a float64 (G,) array; rejects wrong shapes, too-small groups and NaN/inf."""
    r_G = np.asarray(rewards_G, dtype=np.float64)
    if r_G.ndim != 1:
        raise AdvantageError(f"rewards must be a 1-D group of shape (G,), got shape {r_G.shape}")
    if r_G.shape[0] < min_size:
        raise AdvantageError(f"need a group of at least {min_size} reward(s), got {r_G.shape[0]}")
    bad = np.flatnonzero(~np.isfinite(r_G))
    if bad.size:
        raise AdvantageError(f"rewards must be finite, but reward {bad[0]} is {r_G[bad[0]]}")
    return r_G


def _all_equal(r_G: np.ndarray) -> bool:
    """A group with one reward value carries no signal; its advantages must be exactly 0, which
    the floating-point mean (e.g. mean([0.7] * 3) != 0.7) would not give."""
    return bool(np.all(r_G == r_G[0]))


def grpo_advantages(rewards_G: ArrayLike, *, normalize_std: bool = False, eps: float = 1e-6) -> np.ndarray:
    """GRPO: A_i = r_i - mean(r), optionally divided by (std(r) + eps), std the population std.

    Normalising by std is off by default: it up-weights groups whose rewards barely differ (a
    difficulty bias, see Dr. GRPO); eps keeps an all-equal group at A = 0 rather than 0/0.
    """
    r_G = _as_rewards(rewards_G, min_size=1)
    if _all_equal(r_G):
        return np.zeros_like(r_G)
    a_G = r_G - r_G.mean()
    if normalize_std:
        if not eps > 0:
            raise AdvantageError(f"eps must be > 0 to avoid dividing by a zero std, got {eps!r}")
        a_G = a_G / (r_G.std() + eps)
    return a_G


def rloo_advantages(rewards_G: ArrayLike) -> np.ndarray:
    """RLOO: A_i = r_i - mean_{j != i} r_j, i.e. each sample's baseline excludes itself (unbiased).

    Equals G / (G - 1) * (r_i - mean(r)); needs G >= 2 so that every sample has another to compare to.
    """
    r_G = _as_rewards(rewards_G, min_size=2)
    if _all_equal(r_G):
        return np.zeros_like(r_G)
    G = r_G.shape[0]
    others_mean_G = (r_G.sum() - r_G) / (G - 1)
    return r_G - others_mean_G


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
}


def get_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as `name`; AdvantageError listing the known names otherwise."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise AdvantageError(f"unknown advantage estimator {name!r}; supported: {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]
