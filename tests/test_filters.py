"""In-loop cleaning: env failures, staleness gate, zero-variance groups, truncation and repetition."""

import numpy as np

from lockstep.runtime.filters import clean, is_repetitive, to_datums
from lockstep.runtime.types import RolloutGroup, Sample


def group(gid, rewards, version=0, reasons=None, tokens=None, failed=0, sampled=()):
    reasons = reasons or ["stop"] * len(rewards)
    samples = tuple(Sample(tuple(tokens or (5, 6)), (-0.5, -0.25), version, r, float(w), sampled=sampled)
                    for w, r in zip(rewards, reasons))
    return RolloutGroup(gid, (1, 2, 3), samples, failed)


def test_zero_variance_groups_are_dropped_and_counted():
    rep = clean([group("a", [1, 1]), group("b", [0, 1]), group("c", [0, 0])], trainer_version=0, max_staleness=0)
    assert [g.group_id for g in rep.kept] == ["b"] and [g.group_id for g in rep.no_signal] == ["a", "c"]
    assert rep.counts()["filter/zero_variance"] == 2


def test_staleness_gate():
    groups = [group("old", [0, 1], version=3), group("ok", [0, 1], version=4), group("new", [0, 1], version=5)]
    rep = clean(groups, trainer_version=5, max_staleness=1)
    assert [g.group_id for g in rep.kept] == ["ok", "new"] and [g.group_id for g in rep.stale] == ["old"]
    assert len(clean(groups, trainer_version=5, max_staleness=0).stale) == 2


def test_failed_groups_are_set_aside_not_trained():
    rep = clean([group("f", [0, 1], failed=1), group("ok", [0, 1])], trainer_version=0, max_staleness=0)
    assert [g.group_id for g in rep.failed] == ["f"] and [g.group_id for g in rep.kept] == ["ok"]
    assert rep.counts()["env/failed_groups"] == 1


def test_truncation_keep_penalize_and_mask():
    g = group("t", [1, 0, 1], reasons=["length", "stop", "stop"])
    keep = clean([g], trainer_version=0, max_staleness=0, truncation="keep")
    assert keep.truncated == 1 and [s.reward for s in keep.kept[0].samples] == [1, 0, 1]
    pen = clean([g], trainer_version=0, max_staleness=0, truncation="penalize", truncated_reward=-1.0)
    assert [s.reward for s in pen.kept[0].samples] == [-1.0, 0, 1]
    mask = clean([g], trainer_version=0, max_staleness=0, truncation="mask")
    assert [s.stop_reason for s in mask.kept[0].samples] == ["stop", "stop"]  # out of loss and baseline
    only = clean([group("u", [1, 0], reasons=["length", "stop"])], trainer_version=0, max_staleness=0, truncation="mask")
    assert not only.kept and len(only.no_signal) == 1  # one sample left: no baseline, no signal


def test_repetition_flag():
    assert is_repetitive([1, 2, 3] * 6) and not is_repetitive(list(range(20)))
    rep = clean([group("r", [0, 1], tokens=[7, 8, 9] * 6)], trainer_version=0, max_staleness=0)
    assert rep.repetitive == 2


def test_datums_carry_group_centred_advantages_and_sampler_logprobs():
    (d1, d2), starts = to_datums([group("g", [1, 0])])
    assert starts == [2, 2]  # the sampled tokens start after the 3-token prompt's 2 input positions
    assert d1.model_input == (1, 2, 3, 5) and list(d1.loss_fn_inputs["target_tokens"]) == [2, 3, 5, 6]
    assert np.allclose(d1.loss_fn_inputs["advantages"], [0, 0, 0.5, 0.5])
    assert np.allclose(d2.loss_fn_inputs["advantages"], [0, 0, -0.5, -0.5])
    assert np.allclose(d1.loss_fn_inputs["logprobs"], [0, 0, -0.5, -0.25])
    assert list(d1.loss_fn_inputs["weights"]) == [0, 0, 1, 1]
    # gspo's sequence ratio over the sampled tokens only (all ones would take in the prompt, whose
    # logprobs are padded with 0): so a job's gspo stage has every input the loss needs
    assert list(d1.loss_fn_inputs["sequence_ratio_mask"]) == [0, 0, 1, 1]
    from lockstep.losses import LOSSES, missing_input

    assert all(missing_input(loss, {}, [d.loss_fn_inputs for d in (d1, d2)]) is None for loss in LOSSES)


def test_env_inserted_tokens_carry_no_loss():
    (d1, _), _ = to_datums([group("m", [1, 0], sampled=(True, False))])
    assert list(d1.loss_fn_inputs["weights"]) == [0, 0, 1, 0]
    assert list(d1.loss_fn_inputs["sequence_ratio_mask"]) == [0, 0, 1, 0]
    assert np.allclose(d1.loss_fn_inputs["advantages"], [0, 0, 0.5, 0])
    assert np.allclose(d1.loss_fn_inputs["logprobs"], [0, 0, -0.5, 0])


def test_forked_families_get_per_turn_advantages():
    """Family value = mean of its branches' rewards; the shared prefix gets the value's advantage
    among the group's families (GRPO), each continuation its reward minus the family's value, and
    only the owning branch trains the prefix. An unforked episode in the same group is one family."""
    from lockstep.runtime.filters import to_datums
    from lockstep.runtime.types import RolloutGroup, Sample

    def sample(reward, family, owns, fork_at=2):
        return Sample((1, 2, 3, 4), (-0.5,) * 4, 0, "stop", reward, family=family, fork_at=fork_at, owns_prefix=owns)

    g = RolloutGroup("g", (7, 8), (sample(1.0, 0, True), sample(0.0, 0, False), sample(1.0, 1, True),
                                   sample(1.0, 1, False), Sample((5, 6), (-0.1, -0.1), 0, "stop", 0.0)))
    data, _ = to_datums([g])
    values = [0.5, 1.0, 0.0]  # families 0, 1 and the unforked episode
    base = sum(values) / 3
    adv = [d.loss_fn_inputs["advantages"][1:] for d in data]  # after the prompt's one padded position
    w = [d.loss_fn_inputs["weights"][1:] for d in data]
    np.testing.assert_allclose(adv[0], np.float32([0.5 - base] * 2 + [0.5] * 2))  # prefix; 1.0 - 0.5
    np.testing.assert_allclose(adv[1], np.float32([0.0] * 2 + [-0.5] * 2))  # prefix not trained here
    np.testing.assert_allclose(w[1], [0, 0, 1, 1])
    np.testing.assert_allclose(adv[2], np.float32([1.0 - base] * 2 + [0.0] * 2))
    np.testing.assert_allclose(adv[4], np.float32([0.0 - base] * 2))
