"""Batch formation (service/packing.py), pure: budget, order, fair shares, starvation-freedom.

Hand-computed cases first, then properties over random heads (hypothesis), then simulations of many
batches in a row with the fairness state carried between them (one tenant flooding).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.service.packing import PACKED_KINDS, Fairness, Head, fair_shares, form_batch, split_seconds

FB, SAMPLE, OPTIM, SAVE = "forward_backward", "sample", "optim_step", "save_weights"
_order = itertools.count(1)


def head(tenant, tokens, kind=FB, base="b", model=None, order=None) -> Head:
    o = next(_order) if order is None else order
    return Head(f"r{o}", tenant, kind, base, tokens, o, model if model is not None or kind == SAMPLE else f"m{o}")


def batch_of(heads, budget=100, weights=None, served=None):
    b = form_batch(heads, budget=budget, weights=weights or {}, served=served or {})
    by_id = {h.id: h for h in heads}
    return [by_id[i] for i in b.ids], b


# -- hand-computed -------------------------------------------------------------------------------
def test_fair_shares_water_fill_by_weight():
    assert fair_shares({"a": 100, "b": 100}, {"a": 1, "b": 1}, 100) == {"a": 50, "b": 50}
    assert fair_shares({"a": 100, "b": 100}, {"a": 1, "b": 3}, 100) == {"a": 25, "b": 75}
    # b needs only 10: a gets the rest; c's weight 2 takes twice a's share of what is left
    assert fair_shares({"a": 100, "b": 10, "c": 100}, {"a": 1, "b": 1, "c": 2}, 100) == {"a": 30, "b": 10, "c": 60}
    assert fair_shares({"a": 5, "b": 7}, {"a": 1, "b": 1}, 100) == {"a": 5, "b": 7}
    assert fair_shares({}, {}, 100) == {}


def test_nothing_queued_is_an_empty_batch():
    assert form_batch([], budget=10, weights={}, served={}).ids == ()


def test_the_kinds_that_run_alone_run_alone():
    hs = [head("a", 0, OPTIM), head("b", 5), head("a", 5)]
    got, _ = batch_of(hs)
    assert got == [hs[0]]
    assert OPTIM not in PACKED_KINDS and SAVE not in PACKED_KINDS


def test_a_batch_is_one_kind_on_one_base():
    hs = [head("a", 5), head("b", 5, SAMPLE), head("c", 5, base="other"), head("d", 5), head("b", 5, FB)]
    got, _ = batch_of(hs)
    assert [h.id for h in got] == [hs[0].id, hs[3].id, hs[4].id]


def test_at_most_one_request_of_a_model():
    hs = [head("a", 5, model="m"), head("a", 5, model="m"), head("b", 5, model="n")]
    got, _ = batch_of(hs)
    assert [h.id for h in got] == [hs[0].id, hs[2].id]


def test_a_large_request_waits_for_its_share_and_the_small_ones_fill_the_batch():
    """Equal weights, budget 100: b's 60 is over its share (50) while a has 10 x 10 waiting, so a
    fills its share, b's 60 does not fit what is left, and a's remaining heads use the rest."""
    hs = [head("a", 10) for _ in range(10)] + [head("b", 60)]
    got, b = batch_of(hs, served={"a": 0.0, "b": 1.0})
    assert b.lead == "a"
    assert [h.tenant for h in got] == ["a"] * 10


def test_the_lead_s_first_request_goes_in_even_over_its_share():
    hs = [head("a", 10) for _ in range(10)] + [head("b", 60)]
    got, b = batch_of(hs, served={"a": 1.0, "b": 0.0})
    assert b.lead == "b" and got[0].tenant == "b"
    assert [h.tenant for h in got].count("a") == 4  # the 40 left


def test_weights_set_the_shares():
    hs = [head("a", 10) for _ in range(10)] + [head("b", 10) for _ in range(10)]
    got, _ = batch_of(hs, weights={"a": 1, "b": 3})
    assert [h.tenant for h in got].count("a") == 3 and [h.tenant for h in got].count("b") == 7
    got, _ = batch_of(hs, weights={"a": 4, "b": 1})
    assert [h.tenant for h in got].count("a") == 8 and [h.tenant for h in got].count("b") == 2


def test_a_request_larger_than_the_budget_runs_alone_when_its_tenant_leads():
    big, small = head("a", 500), head("b", 5)
    assert batch_of([big, small], served={"a": 1.0})[0] == [small]
    assert batch_of([big, small], served={"b": 1.0})[0] == [big]


def test_max_members_caps_a_batch():
    """The host holds max_models trainers: a batch never readies more members than that."""
    hs = [head(t, 1) for t in "abcdefgh"]
    assert len(form_batch(hs, budget=100, weights={}, served={}, max_members=3).ids) == 3
    assert len(form_batch(hs, budget=100, weights={}, served={}).ids) == 8


def test_zero_token_requests_count_as_one():
    hs = [head("a", 0) for _ in range(7)]
    assert len(batch_of(hs, budget=5)[0]) == 5


def test_split_seconds_by_tokens():
    assert split_seconds(2.0, {"a": [10, 30], "b": [40]}) == {"a": 1.0, "b": 1.0}
    assert split_seconds(1.0, {}) == {}


def test_fairness_forgets_idle_time():
    f = Fairness()
    f.charge(0.0, {"a": 10.0}, {"a": 1})
    assert f.served(["a", "b"]) == {"a": 10.0, "b": 0.0}
    f.charge(4.0, {"b": 2.0}, {"b": 2})  # b led at 4.0 (it was behind); its 2 s count 1 at weight 2
    assert f.served(["a", "b", "c"]) == {"a": 10.0, "b": 5.0, "c": 4.0}  # c, new, starts level with the lead
    f.charge(12.0, {}, {})
    assert f.served(["a"]) == {"a": 12.0}  # idle a owes nothing from its past


# -- properties ----------------------------------------------------------------------------------
@st.composite
def workloads(draw):
    tenants = draw(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True))
    heads = []
    for o in range(1, draw(st.integers(1, 40)) + 1):
        t = draw(st.sampled_from(tenants))
        kind = draw(st.sampled_from([FB, FB, FB, SAMPLE, SAMPLE, OPTIM]))
        model = None if kind == SAMPLE else draw(st.sampled_from([f"{t}{i}" for i in range(4)]))
        heads.append(Head(f"r{o}", t, kind, draw(st.sampled_from(["b", "b", "c"])), draw(st.integers(0, 150)), o, model))
    weights = {t: draw(st.sampled_from([1, 1, 2, 3, 10])) for t in tenants}
    served = {t: draw(st.floats(0, 100)) for t in tenants}
    return heads, weights, served, draw(st.integers(1, 200))


@settings(max_examples=400, deadline=None)
@given(workloads())
def test_properties_of_any_batch(w):
    heads, weights, served, budget = w
    b = form_batch(heads, budget=budget, weights=weights, served=served)
    capped = form_batch(heads, budget=budget, weights=weights, served=served, max_members=2)
    assert capped.ids == b.ids[:2], "the cap stops the same picking early"
    by_id = {h.id: h for h in heads}
    got = [by_id[i] for i in b.ids]
    assert got and len(set(b.ids)) == len(b.ids)
    # Candidates: the earliest head of each model only.
    earliest = {}
    for h in sorted(heads, key=lambda h: h.order):
        earliest.setdefault(h.model or h.id, h)
    cands = [h for h in heads if earliest[h.model or h.id] is h]
    # The lead: least served (ties: oldest head), and its oldest head goes first.
    lead = min({h.tenant for h in cands}, key=lambda t: (served[t], min(h.order for h in cands if h.tenant == t)))
    assert b.lead == lead and got[0] == min((h for h in cands if h.tenant == lead), key=lambda h: h.order)
    if got[0].kind not in PACKED_KINDS or got[0].cost > budget:
        assert len(got) == 1
        return
    # One kind, one base, one request per model, within the budget.
    assert {(h.kind, h.base) for h in got} == {(got[0].kind, got[0].base)}
    models = [h.model for h in got if h.model is not None]
    assert len(models) == len(set(models))
    assert sum(h.cost for h in got) <= budget
    group = [h for h in cands if (h.kind, h.base) == (got[0].kind, got[0].base)]
    left = budget - sum(h.cost for h in got)
    for t in {h.tenant for h in group}:
        mine = sorted((h for h in group if h.tenant == t), key=lambda h: h.order)
        taken = [h for h in got if h.tenant == t]
        assert taken == mine[: len(taken)], "a tenant's requests go in in its arrival order"
        if len(taken) < len(mine):
            assert mine[len(taken)].cost > left, "a request that fits what is left is not left out"
    # Fair share: a tenant gets its weighted share, less at most one of its requests and what the
    # lead's first request took over the lead's own share.
    shares = fair_shares({t: sum(h.cost for h in group if h.tenant == t) for t in {h.tenant for h in group}},
                         {t: weights[t] for t in weights}, budget)
    excess = max(0.0, got[0].cost - shares[lead])
    for t, share in shares.items():
        if t == lead:
            continue
        taken = sum(h.cost for h in got if h.tenant == t)
        largest = max(h.cost for h in group if h.tenant == t)
        assert taken >= share - largest - excess - 1e-9, (t, taken, share, largest, excess)


# -- many batches --------------------------------------------------------------------------------
def simulate(queued, arrivals, weights, budget, rounds, until=lambda batches: False):
    """Form up to `rounds` batches in a row (fewer once `until(batches)`), the fairness state
    carried between them; a batch's seconds are its tokens; `arrivals(n, served)` adds heads after
    batch n. Returns the batches."""
    fairness, batches, queued = Fairness(), [], list(queued)
    for n in range(rounds):
        if not queued or until(batches):
            break
        b = form_batch(queued, budget=budget, weights=weights, served=fairness.served({h.tenant for h in queued}))
        got = [h for h in queued if h.id in b.ids]
        batches.append(got)
        costs = {}
        for h in got:
            costs.setdefault(h.tenant, []).append(h.cost)
        fairness.charge(b.lead_time, split_seconds(sum(h.cost for h in got), costs), weights)
        queued = [h for h in queued if h.id not in b.ids] + arrivals(n, got)
    return batches


def test_a_flood_of_large_requests_does_not_hold_a_small_tenant_back():
    """Tenant f keeps 20 requests of 90 tokens queued (budget 100); tenant s has one request of 10
    queued at a time (the next arrives once it is served): s is in every batch, f gets the rest."""
    def arrivals(n, got):
        return [head(h.tenant, h.tokens) for h in got]  # each served request is followed by another

    batches = simulate([head("f", 90) for _ in range(20)] + [head("s", 10)], arrivals, {}, 100, 60)
    assert len(batches) == 60
    assert all([h.tenant for h in b].count("s") == 1 for b in batches)
    assert all([h.tenant for h in b].count("f") == 1 for b in batches)


def test_a_tenant_whose_requests_exceed_its_share_gets_no_more_than_its_share():
    """Equal weights, budget 100: f floods requests of 60 (over its share of 50), s keeps five
    models' requests of 10 queued. Over many batches both get the same tokens (a batch taking
    f's 60 and s's 40 every time would give f half as much again as s)."""
    def arrivals(n, got):
        return [head(h.tenant, h.tokens) for h in got]

    batches = simulate([head("f", 60) for _ in range(20)] + [head("s", 10) for _ in range(5)], arrivals, {}, 100, 400)
    tokens = {t: sum(h.cost for b in batches for h in b if h.tenant == t) for t in "fs"}
    assert tokens["f"] / tokens["s"] == pytest.approx(1.0, rel=0.05), tokens


def test_long_run_shares_follow_the_weights():
    """Two tenants always backlogged with mixed sizes, weights 1 and 3: served tokens 1 : 3."""
    sizes = itertools.cycle([7, 30, 12, 55, 3, 20, 41])

    def arrivals(n, got):
        return [head(h.tenant, next(sizes)) for h in got]

    queued = [head(t, next(sizes)) for _ in range(10) for t in "ab"]
    batches = simulate(queued, arrivals, {"a": 1, "b": 3}, 100, 400)
    tokens = {t: sum(h.cost for b in batches for h in b if h.tenant == t) for t in "ab"}
    assert tokens["b"] / tokens["a"] == pytest.approx(3.0, rel=0.05), tokens


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 400), st.sampled_from([FB, SAMPLE, OPTIM])),
                min_size=1, max_size=25),
       st.integers(20, 150))
def test_no_request_waits_for_ever_even_under_a_flood(initial, budget):
    """Whatever is queued (requests larger than a share, or than the budget, included), while
    tenant z keeps 30 small requests queued (each one served is replaced), every request queued at
    the start is served: z's heads would otherwise fill every batch past the others' shares."""
    queued = [head(t, n, kind) for t, n, kind in initial]
    small = max(1, budget // 10)
    ids = {h.id for h in queued}

    def arrivals(n, got):
        return [head("z", small) for h in got if h.tenant == "z"]

    def all_served(batches):
        return ids <= {h.id for b in batches for h in b}

    batches = simulate([head("z", small) for _ in range(30)] + queued, arrivals, {}, budget, 1000, until=all_served)
    assert all_served(batches), "a request was never served"
