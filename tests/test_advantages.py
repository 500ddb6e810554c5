"""Advantage estimators checked against values worked out by hand.

Group rewards r = [1, 2, 6]: mean 3, population std sqrt((4 + 1 + 9) / 3) = sqrt(14/3).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from lockstep.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageError,
    get_estimator,
    grpo_advantages,
    rloo_advantages,
)


def test_grpo_mean_centred():
    np.testing.assert_allclose(grpo_advantages([1.0, 2.0, 6.0]), [-2.0, -1.0, 3.0])


def test_grpo_std_normalised():
    std = math.sqrt(14 / 3)
    expected = [-2.0 / (std + 1e-6), -1.0 / (std + 1e-6), 3.0 / (std + 1e-6)]
    np.testing.assert_allclose(grpo_advantages([1.0, 2.0, 6.0], normalize_std=True), expected, rtol=1e-12)


def test_grpo_custom_eps():
    # r = [0, 1]: centred [-0.5, 0.5], std 0.5, eps 0.5 -> divide by 1.0
    np.testing.assert_allclose(grpo_advantages([0.0, 1.0], normalize_std=True, eps=0.5), [-0.5, 0.5])


def test_grpo_equal_rewards_give_zero_even_normalised():
    np.testing.assert_array_equal(grpo_advantages([0.7, 0.7, 0.7], normalize_std=True), [0.0, 0.0, 0.0])


def test_grpo_single_sample_is_zero():
    np.testing.assert_array_equal(grpo_advantages([5.0]), [0.0])


def test_rloo_leave_one_out():
    # r_i - mean of the others: 1 - 4, 2 - 3.5, 6 - 1.5
    np.testing.assert_allclose(rloo_advantages([1.0, 2.0, 6.0]), [-3.0, -1.5, 4.5])


def test_rloo_equal_rewards_give_exact_zero():
    np.testing.assert_array_equal(rloo_advantages([0.7, 0.7, 0.7]), [0.0, 0.0, 0.0])


def test_grpo_equal_rewards_give_exact_zero_unnormalised():
    np.testing.assert_array_equal(grpo_advantages([0.1, 0.1, 0.1]), [0.0, 0.0, 0.0])


def test_rloo_pair():
    np.testing.assert_allclose(rloo_advantages([1.0, 0.0]), [1.0, -1.0])


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages([1.0])


@pytest.mark.parametrize("fn", [grpo_advantages, rloo_advantages])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_rewards_rejected(fn, bad):
    with pytest.raises(ValueError, match="rewards must be finite, but reward 1"):
        fn([0.0, bad, 1.0])


def test_rewards_must_be_one_group():
    with pytest.raises(AdvantageError, match=r"1-D group of shape \(G,\)"):
        grpo_advantages([[1.0, 2.0], [3.0, 4.0]])


def test_empty_group_rejected():
    with pytest.raises(AdvantageError, match="at least 1"):
        grpo_advantages([])


def test_grpo_rejects_non_positive_eps():
    with pytest.raises(AdvantageError, match="eps must be > 0"):
        grpo_advantages([0.0, 1.0], normalize_std=True, eps=0.0)


def test_registry():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo"}
    assert get_estimator("rloo") is rloo_advantages
    np.testing.assert_allclose(get_estimator("grpo")([1.0, 2.0, 6.0]), [-2.0, -1.0, 3.0])


def test_unknown_estimator_lists_names():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; supported: grpo, rloo"):
        get_estimator("ppo")


def test_advantage_error_is_value_error():
    assert issubclass(AdvantageError, ValueError)
