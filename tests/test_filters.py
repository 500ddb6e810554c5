"""In-loop cleaning: staleness gate, zero-variance groups, truncation and repetition, with counts."""

import numpy as np

from lockstep.runtime.filters import clean, is_repetitive, to_datums
from lockstep.runtime.types import RolloutGroup, Sample


def group(gid, rewards, version=0, reasons=None, tokens=None):
    reasons = reasons or ["stop"] * len(rewards)
    samples = tuple(Sample(tuple(tokens or (5, 6)), (-0.5, -0.25), version, r, float(w)) for w, r in zip(rewards, reasons))
    return RolloutGroup(gid, (1, 2, 3), None, samples)


def test_zero_variance_groups_are_dropped_and_counted():
    rep = clean([group("a", [1, 1]), group("b", [0, 1]), group("c", [0, 0])], trainer_version=0, max_staleness=0)
    assert [g.group_id for g in rep.kept] == ["b"] and rep.zero_variance == 2


def test_staleness_gate():
    groups = [group("old", [0, 1], version=3), group("ok", [0, 1], version=4), group("new", [0, 1], version=5)]
    rep = clean(groups, trainer_version=5, max_staleness=1)
    assert [g.group_id for g in rep.kept] == ["ok", "new"] and rep.stale == 1
    assert clean(groups, trainer_version=5, max_staleness=0).stale == 2


def test_truncated_samples_counted_and_optionally_penalised():
    g = group("t", [1, 0], reasons=["length", "stop"])
    assert clean([g], trainer_version=0, max_staleness=0).truncated == 1
    rep = clean([g], trainer_version=0, max_staleness=0, truncated_penalty=0.0)
    assert rep.zero_variance == 1 and not rep.kept  # the penalty removed the only reward


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
