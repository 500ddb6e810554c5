"""Loss functions checked against values worked out by hand.

Shared batch (4 tokens) used by most tests:
    lp = [-1.0, -2.0, -1.0, -0.5]      learner logprobs
    q  = [-1.5, -1.0, -1.1, -1.0]      sampler logprobs
    A  = [ 2.0, -1.0,  1.0, -1.0]      advantages
    lp - q = [0.5, -1.0, 0.1, 0.5]  ->  ratio = [e^0.5, e^-1, e^0.1, e^0.5] = [1.6487, 0.3679, 1.1052, 1.6487]
"""

from __future__ import annotations

import math

import pytest
import torch

from lockstep.losses import (
    LOSS_CONFIG_KEYS,
    LOSSES,
    LossError,
    LossInputs,
    apply_corrections,
    compute_loss,
    get_loss,
    register_loss,
)
from lockstep.losses.importance_sampling import importance_sampling_loss
from lockstep.losses.types import is_metric_key

E = math.exp
LP = [-1.0, -2.0, -1.0, -0.5]
Q = [-1.5, -1.0, -1.1, -1.0]
A = [2.0, -1.0, 1.0, -1.0]


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def make_inputs(lp: list[float] = LP, q: list[float] = Q, adv: list[float] = A, **kw) -> LossInputs:
    lp_T = t(lp).requires_grad_(True)
    return LossInputs.create(lp_T, sampler_logprobs_T=t(q), advantages_T=t(adv), **kw)


def loss_and_grad(name: str, inputs: LossInputs, config: dict | None = None):
    loss_T, metrics = compute_loss(name, inputs, config or {})
    (grad_T,) = torch.autograd.grad(loss_T.sum(), inputs.logprobs_T)
    return loss_T.detach(), grad_T, metrics


def assert_close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, t(expected), rtol=1e-5, atol=1e-6)


# --- individual losses -------------------------------------------------------------------------


def test_cross_entropy_is_weighted_nll_summed():
    inputs = make_inputs(weights_T=t([1.0, 0.5, 0.0, 2.0]))
    loss_T, grad_T, metrics = loss_and_grad("cross_entropy", inputs)
    assert_close(loss_T, [1.0, 1.0, 0.0, 1.0])  # -lp * w
    assert_close(grad_T, [-1.0, -0.5, 0.0, -2.0])  # d/dlp = -w
    assert metrics == {}


def test_cross_entropy_default_weights_are_ones():
    loss_T, _, _ = loss_and_grad("cross_entropy", LossInputs.create(t(LP).requires_grad_(True)))
    assert_close(loss_T, [1.0, 2.0, 1.0, 0.5])


def test_importance_sampling():
    loss_T, grad_T, metrics = loss_and_grad("importance_sampling", make_inputs())
    # -ratio * A
    assert_close(loss_T, [-2 * E(0.5), E(-1.0), -E(0.1), E(0.5)])
    # d/dlp of -exp(lp - q) * A is the same expression
    assert_close(grad_T, [-2 * E(0.5), E(-1.0), -E(0.1), E(0.5)])
    assert metrics["importance_ratio:max"] == pytest.approx(E(0.5), rel=1e-6)
    assert metrics["importance_ratio:mean"] == pytest.approx((2 * E(0.5) + E(-1.0) + E(0.1)) / 4, rel=1e-6)


def test_ppo_default_band():
    loss_T, grad_T, metrics = loss_and_grad("ppo", make_inputs())
    # t0: ratio 1.65, A=2 -> min(3.30, 1.2*2=2.4) = 2.4 (clipped)
    # t1: ratio 0.37, A=-1 -> min(-0.37, 0.8*-1=-0.8) = -0.8 (clipped)
    # t2: ratio 1.105 inside band -> unclipped
    # t3: ratio 1.65, A=-1 -> min(-1.65, -1.2) = -1.65 (unclipped: pessimistic branch)
    assert_close(loss_T, [-2.4, 0.8, -E(0.1), E(0.5)])
    assert_close(grad_T, [0.0, 0.0, -E(0.1), E(0.5)])
    assert metrics == {"clip_fraction:mean": 0.5}


def test_ppo_config_thresholds():
    loss_T, _, metrics = loss_and_grad("ppo", make_inputs(), {"clip_low_threshold": 0.2, "clip_high_threshold": 1.5})
    # t0 now clipped at 1.5 -> -3.0; t1 ratio 0.37 > 0.2 -> unclipped -(e^-1 * -1)
    assert_close(loss_T, [-3.0, E(-1.0), -E(0.1), E(0.5)])
    assert metrics["clip_fraction:mean"] == 0.25


def test_ppo_per_token_bounds_override_config():
    inputs = make_inputs(clip_low_T=t([0.8, 0.3, 0.8, 0.8]), clip_high_T=t([2.0, 1.2, 1.2, 1.2]))
    loss_T, grad_T, metrics = loss_and_grad("ppo", inputs, {"clip_high_threshold": 1.1})
    # t0: ratio 1.65 < 2.0 -> unclipped; t1: 0.37 > 0.3 -> unclipped; t2: 1.105 < 1.2 (the per-token
    # ceiling wins over the config's 1.1) -> unclipped
    assert_close(loss_T, [-2 * E(0.5), E(-1.0), -E(0.1), E(0.5)])
    assert_close(grad_T, [-2 * E(0.5), E(-1.0), -E(0.1), E(0.5)])
    assert metrics["clip_fraction:mean"] == 0.0


def test_cispo_value_and_gradient():
    loss_T, grad_T, metrics = loss_and_grad("cispo", make_inputs())
    # clip(ratio, 0.8, 1.2) = [1.2, 0.8, e^0.1, 1.2]; loss = -w * lp * A
    assert_close(loss_T, [2.4, -1.6, E(0.1), -0.6])
    # gradient = -clip(ratio) * A: clipping bounds the weight but never zeroes the gradient
    assert_close(grad_T, [-2.4, 0.8, -E(0.1), 1.2])
    assert metrics == {"clip_fraction:mean": 0.75}


def test_dro_default_beta():
    loss_T, grad_T, _ = loss_and_grad("dro", make_inputs())
    # -(lp*A - 0.5*0.05*(lp-q)^2), (lp-q)^2 = [0.25, 1.0, 0.01, 0.25]
    assert_close(loss_T, [2.0 + 0.00625, -2.0 + 0.025, 1.0 + 0.00025, -0.5 + 0.00625])
    # gradient = -A + beta * (lp - q)
    assert_close(grad_T, [-2.0 + 0.025, 1.0 - 0.05, -1.0 + 0.005, 1.0 + 0.025])


def test_dro_beta_from_config():
    loss_T, _, metrics = loss_and_grad("dro", make_inputs(), {"beta": 1.0})
    assert_close(loss_T, [2.0 + 0.125, -2.0 + 0.5, 1.0 + 0.005, -0.5 + 0.125])
    assert metrics["penalty:mean"] == pytest.approx((0.125 + 0.5 + 0.005 + 0.125) / 4, rel=1e-6)


# --- gspo --------------------------------------------------------------------------------------

# Two datums: tokens 0,1 in datum 0, tokens 2,3 in datum 1; token 3 is outside the ratio mask.
# s_0 = exp(mean(0.5, -1.0)) = e^-0.25 = 0.7788;  s_1 = exp(0.1) = 1.1052 (token 3 ignored)
GSPO_KW = dict(segment_T=torch.tensor([0, 0, 1, 1]), num_segments=2, mask_T=t([1.0, 1.0, 1.0, 0.0]))


def test_gspo_sequence_ratio_wide_band():
    inputs = make_inputs(**GSPO_KW)
    loss_T, grad_T, metrics = loss_and_grad("gspo", inputs, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5})
    s0, s1 = E(-0.25), E(0.1)
    assert_close(loss_T, [-2 * s0, s0, -s1, s1])  # -s_seg * A
    # per-token gradient is s_seg * A (the sequence ratio is a constant multiplier per datum)
    assert_close(grad_T, [-2 * s0, s0, -s1, s1])
    assert metrics["clip_fraction:mean"] == 0.0
    assert metrics["sequence_ratio:mean"] == pytest.approx((s0 + s1) / 2, rel=1e-6)


def test_gspo_default_band_clips_whole_datum_ratio():
    loss_T, grad_T, metrics = loss_and_grad("gspo", make_inputs(**GSPO_KW))
    s0, s1 = E(-0.25), E(0.1)  # s0 = 0.7788 < 0.8
    # t0: A=2 -> min(2*s0, 2*0.8) = 2*s0 (unclipped); t1: A=-1 -> min(-s0, -0.8) = -0.8 (clipped)
    assert_close(loss_T, [-2 * s0, 0.8, -s1, s1])
    assert_close(grad_T, [-2 * s0, 0.0, -s1, s1])
    assert metrics["clip_fraction:mean"] == 0.25


def test_gspo_segment_without_masked_tokens_has_ratio_one():
    inputs = make_inputs(
        lp=LP + [-3.0],
        q=Q + [-1.0],  # lp - q = -2 would give e^-2 if it were counted
        adv=A + [1.0],
        segment_T=torch.tensor([0, 0, 1, 1, 2]),
        num_segments=3,
        mask_T=t([1.0, 1.0, 1.0, 0.0, 0.0]),
    )
    loss_T, grad_T, metrics = loss_and_grad("gspo", inputs, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5})
    assert loss_T[4].item() == pytest.approx(-1.0)
    assert grad_T[4].item() == pytest.approx(-1.0)
    assert metrics["sequence_ratio:mean"] == pytest.approx((E(-0.25) + E(0.1) + 1.0) / 3, rel=1e-6)


# --- corrections -------------------------------------------------------------------------------
# Behaviour weights w = exp(sg(lp) - q) = [e^0.5, e^-1, e^0.1, e^0.5] = [1.65, 0.37, 1.105, 1.65]


def test_tis_importance_sampling_gradient_is_minus_w_times_A():
    loss_T, grad_T, metrics = loss_and_grad("importance_sampling", make_inputs(), {"tis_cap": 1.5})
    w = [1.5, E(-1.0), E(0.1), 1.5]  # capped at 1.5
    expected = [-w[i] * A[i] for i in range(4)]
    assert_close(loss_T, expected)  # inner ratio is exp(lp - sg(lp)) = 1
    assert_close(grad_T, expected)
    assert metrics["tis_clipped_fraction:mean"] == 0.5
    assert metrics["tis_weight:mean"] == pytest.approx(sum(w) / 4, rel=1e-6)
    assert metrics["mismatch_abs:max"] == pytest.approx(1.0)
    assert metrics["mismatch_abs:mean"] == pytest.approx((0.5 + 1.0 + 0.1 + 0.5) / 4, rel=1e-6)
    assert metrics["importance_ratio:mean"] == pytest.approx(1.0)  # the inner loss saw q := sg(lp)
    assert "mis_masked_fraction:mean" not in metrics


def test_mis_masks_out_of_band_tokens_exactly():
    loss_T, grad_T, metrics = loss_and_grad("importance_sampling", make_inputs(), {"mis_low": 0.5, "mis_high": 1.5})
    # only token 2 (w = 1.105) lies in [0.5, 1.5]
    assert loss_T.tolist()[0] == 0.0 and loss_T.tolist()[1] == 0.0 and loss_T.tolist()[3] == 0.0
    assert_close(loss_T, [0.0, 0.0, -E(0.1), 0.0])
    assert_close(grad_T, [0.0, 0.0, -E(0.1), 0.0])
    assert metrics["mis_masked_fraction:mean"] == 0.75
    assert "tis_weight:mean" not in metrics


def test_mis_then_tis():
    config = {"mis_low": 0.3, "mis_high": 1.2, "tis_cap": 1.0}
    loss_T, grad_T, metrics = loss_and_grad("importance_sampling", make_inputs(), config)
    # kept: t1 (0.37), t2 (1.105 -> capped to 1.0); t0, t3 masked (1.65 > 1.2)
    assert_close(loss_T, [0.0, E(-1.0), -1.0, 0.0])
    assert_close(grad_T, [0.0, E(-1.0), -1.0, 0.0])
    assert metrics["mis_masked_fraction:mean"] == 0.5
    assert metrics["tis_clipped_fraction:mean"] == 0.25  # only t2's applied weight was lowered
    assert metrics["tis_weight:mean"] == pytest.approx((E(-1.0) + 1.0) / 4, rel=1e-6)


def test_one_sided_mis_band():
    _, _, metrics = loss_and_grad("importance_sampling", make_inputs(), {"mis_high": 1.2})
    assert metrics["mis_masked_fraction:mean"] == 0.5  # t0, t3


def test_corrections_wrap_cross_entropy_and_ppo():
    inputs = make_inputs()
    ce_T, ce_grad_T, _ = loss_and_grad("cross_entropy", inputs, {"tis_cap": 1.5})
    w = [1.5, E(-1.0), E(0.1), 1.5]
    assert_close(ce_T, [-LP[i] * w[i] for i in range(4)])
    assert_close(ce_grad_T, [-w[i] for i in range(4)])
    ppo_T, _, metrics = loss_and_grad("ppo", make_inputs(), {"tis_cap": 1.5})
    # with the anchor at sg(lp) the PPO ratio is 1: never clipped, loss = -w * A
    assert_close(ppo_T, [-w[i] * A[i] for i in range(4)])
    assert metrics["clip_fraction:mean"] == 0.0


def test_no_correction_keys_calls_loss_unchanged():
    inputs = make_inputs()
    seen: list[dict] = []

    def spy(inp: LossInputs, config):
        seen.append(dict(config))
        assert inp is inputs
        return importance_sampling_loss(inp, config)

    loss_T, metrics = apply_corrections(spy, inputs, {})
    assert seen == [{}]
    assert_close(loss_T.detach(), [-2 * E(0.5), E(-1.0), -E(0.1), E(0.5)])
    assert not any(k.startswith(("tis_", "mis_", "mismatch_")) for k in metrics)


def test_correction_keys_are_stripped_from_inner_config():
    seen: list[dict] = []

    def spy(inp: LossInputs, config):
        seen.append(dict(config))
        return importance_sampling_loss(inp, config)

    apply_corrections(spy, make_inputs(), {"tis_cap": 2.0, "mis_low": 0.1, "beta": 0.3})
    assert seen == [{"beta": 0.3}]


@pytest.mark.parametrize("cap", [0.0, -1.0])
def test_tis_cap_must_be_positive(cap):
    with pytest.raises(LossError, match=r"loss_fn_config\['tis_cap'\] must be a number in \(0, 1e6\]"):
        compute_loss("importance_sampling", make_inputs(), {"tis_cap": cap})


def test_mis_band_must_be_ordered():
    with pytest.raises(LossError, match="mis_low must be < mis_high"):
        compute_loss("ppo", make_inputs(), {"mis_low": 1.0, "mis_high": 1.0})  # each in range, the band empty


# --- registry and validation -------------------------------------------------------------------


def test_builtin_losses_registered():
    assert set(LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"}
    assert LOSS_CONFIG_KEYS["ppo"] == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert LOSS_CONFIG_KEYS["dro"] == {"beta": 0.05}


@pytest.mark.parametrize("name", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_metric_keys_have_reductions(name):
    _, metrics = compute_loss(name, make_inputs(**GSPO_KW), {"tis_cap": 2.0, "mis_low": 0.1})
    assert metrics  # corrections always add mismatch_abs
    for key, value in metrics.items():
        assert is_metric_key(key), key
        assert isinstance(value, float)


def test_is_metric_key():
    assert is_metric_key("clip_fraction:mean")
    assert not is_metric_key("clip_fraction")
    assert not is_metric_key("clip_fraction:median")


def test_unknown_loss_lists_supported():
    with pytest.raises(LossError, match=r"unknown loss 'foo'; supported: cross_entropy, importance_sampling, ppo"):
        get_loss("foo")


def test_stable_reinforce_is_refused_with_reason():
    with pytest.raises(LossError) as info:
        compute_loss("stable_reinforce", make_inputs())
    message = str(info.value)
    assert "'stable_reinforce' is not supported" in message
    assert "unpublished" in message
    assert "supported: cross_entropy, importance_sampling, ppo, cispo, dro, gspo" in message


def test_unknown_config_key_names_allowed_keys():
    with pytest.raises(LossError) as info:
        compute_loss("ppo", make_inputs(), {"clip_low": 0.5})
    message = str(info.value)
    assert "'clip_low'" in message
    assert "allowed: clip_high_threshold, clip_low_threshold, mis_high, mis_low, tis_cap" in message


def test_cross_entropy_rejects_any_loss_config():
    with pytest.raises(LossError, match="unknown config key.*'beta'"):
        compute_loss("cross_entropy", make_inputs(), {"beta": 0.1})


@pytest.mark.parametrize("value", [math.nan, math.inf, "0.5", True])
def test_config_values_must_be_finite_numbers(value):
    with pytest.raises(LossError, match=r"loss_fn_config\['beta'\] must be a number in \[0, 1000\]"):
        compute_loss("dro", make_inputs(), {"beta": value})


@pytest.mark.parametrize(
    "field, label",
    [("advantages_T", "advantages"), ("weights_T", "weights"), ("sampler_logprobs_T", "logprobs")],
)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_inputs_name_the_field(field, label, bad):
    inputs = make_inputs()
    values = {"advantages_T": A, "weights_T": [1.0] * 4, "sampler_logprobs_T": Q}[field][:]
    values[2] = bad
    inputs = LossInputs.create(inputs.logprobs_T, **{**_fields(inputs), field: t(values)})
    with pytest.raises(LossError, match=rf"loss input '{label}.*token 2"):
        compute_loss("importance_sampling", inputs)


def _fields(inputs: LossInputs) -> dict:
    return dict(
        sampler_logprobs_T=inputs.sampler_logprobs_T,
        advantages_T=inputs.advantages_T,
        weights_T=inputs.weights_T,
    )


def test_shape_mismatch_rejected():
    with pytest.raises(LossError, match=r"advantages_T must have shape \(4,\)"):
        make_inputs(adv=[1.0, 2.0])


def test_segment_out_of_range_rejected():
    inputs = make_inputs(segment_T=torch.tensor([0, 0, 1, 2]), num_segments=2)
    with pytest.raises(LossError, match=r"segment_T must lie in \[0, 2\)"):
        compute_loss("gspo", inputs)


def test_clip_floor_above_ceiling_rejected():
    """A per-token floor over the config's ceiling (config floors above 1 are out of range)."""
    with pytest.raises(LossError, match="token 0 has clip_low_threshold=1.5"):
        compute_loss("ppo", make_inputs(clip_low_T=t([1.5] * 4)), {"clip_high_threshold": 1.2})


def test_register_loss_refuses_duplicates_and_custom_losses_work():
    def halved_ce(inputs: LossInputs, config):
        return -0.5 * inputs.logprobs_T, {"custom:sum": 1.0}

    with pytest.raises(LossError, match="'cross_entropy' is already registered"):
        register_loss("cross_entropy", halved_ce)
    register_loss("halved_ce", halved_ce)  # config_keys=None: accepts any key
    try:
        loss_T, metrics = compute_loss("halved_ce", make_inputs(), {"anything": 3.0})
        assert_close(loss_T.detach(), [0.5, 1.0, 0.5, 0.25])
        assert metrics == {"custom:sum": 1.0}
        register_loss("halved_ce", lambda i, c: (i.logprobs_T, {"bad key": 1.0}), overwrite=True)
        with pytest.raises(LossError, match="metric key"):
            compute_loss("halved_ce", make_inputs())
    finally:
        LOSSES.pop("halved_ce")
        LOSS_CONFIG_KEYS.pop("halved_ce")


def test_empty_batch():
    inputs = LossInputs.create(torch.zeros(0, requires_grad=True))
    loss_T, metrics = compute_loss("ppo", inputs, {"tis_cap": 2.0})
    assert loss_T.shape == (0,)
    assert metrics["clip_fraction:mean"] == 0.0 and metrics["mismatch_abs:max"] == 0.0
