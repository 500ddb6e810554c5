"""Packed batches through the real store and Executor: the API counts each request's tokens, a batch
is claimed atomically (never by two executors, SQLite and PostgreSQL), a member that fails inside a
batch fails alone, and a flooding tenant cannot keep another out of the batches.

Everything is driven step by step (claim, run, finish), never by waiting: the tests synchronise on
the requests' states in the store.
"""

from __future__ import annotations

import json
import os
import random
import threading

import pytest
from sqlalchemy import update

from lockstep.service import queue, wire
from lockstep.service.db import Model, Request, SamplingSession, connect
from lockstep.service.packing import Packer
from lockstep.service.tenants import create_tenant
from lockstep.service.types import RequestKind, RequestState
from test_service_api import fwdbwd, new_model, post, serving
from test_service_backends import postgres_url  # noqa: F401 - a fixture

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


def store_url(store, tmp_path, request) -> str:
    return request.getfixturevalue("postgres_url") if store == "postgres" else f"sqlite:///{tmp_path / 'db.sqlite'}"


def queue_samples(sessions, tenant_id: str, session_id: str, tokens, base="lockstep/tiny") -> list[str]:
    """Sampling requests straight into the store (their size as the API would count it)."""
    with sessions() as s:
        if s.get(SamplingSession, session_id) is None:
            s.add(SamplingSession(id=session_id, tenant_id=tenant_id, session_id="x", base_model=base, vocab_size=256))
            s.commit()
        return [queue.submit(s, tenant_id=tenant_id, kind=RequestKind.SAMPLE, payload=b"{}",
                             sampling_session_id=session_id, num_tokens=n).id for n in tokens]


def row(sessions, rid):
    with sessions() as s:
        return s.get(Request, rid)


# -- the API counts tokens -----------------------------------------------------------------------
def test_the_api_stores_each_request_s_size_in_a_batch(tmp_path, builtin_dir):
    with serving(tmp_path, builtin_dir) as (client, sessions, key, _):
        sid, mid = new_model(client, key)
        r = client.post("/api/v1/forward_backward", content=fwdbwd(mid, tokens=(5, 6, 7, 8, 9)),
                        headers={"X-API-Key": key, "Content-Type": "application/x-protobuf"})
        assert r.status_code == 200, r.text
        assert row(sessions, r.json()["request_id"]).num_tokens == 5
        ss = post(client, "create_sampling_session", key, {"session_id": sid, "sampling_session_seq_id": 0,
                                                           "base_model": "lockstep/tiny"}).json()["sampling_session_id"]
        r = post(client, "asample", key, {"sampling_session_id": ss, "num_samples": 3,
                                          "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4]}]},
                                          "sampling_params": {"max_tokens": 6}})
        assert r.status_code == 200, r.text
        assert row(sessions, r.json()["request_id"]).num_tokens == 3 * (4 + 6)


# -- claiming is atomic --------------------------------------------------------------------------
@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_two_executors_never_claim_the_same_request(tmp_path, store, request):
    _, sessions = connect(store_url(store, tmp_path, request))
    with sessions() as s:
        a, _ = create_tenant(s, f"a-{store}-{tmp_path.name}"[:64])
        b, _ = create_tenant(s, f"b-{store}-{tmp_path.name}"[:64])
    ids = queue_samples(sessions, a.id, f"ssa-{tmp_path.name}", [10] * 6) + \
        queue_samples(sessions, b.id, f"ssb-{tmp_path.name}", [10] * 6)
    # Both read the same heads and form the same batch; the first claim wins all of it.
    with sessions() as s1, sessions() as s2:
        heads1, heads2 = queue.heads(s1), queue.heads(s2)
        assert {h.id for h in heads1} == {h.id for h in heads2} >= set(ids)
        chosen = [h.id for h in heads1 if h.id in ids]
        won = queue.claim_batch(s1, chosen, "exec-1")
        lost = queue.claim_batch(s2, chosen, "exec-2")
    assert [m.id for m in won] == chosen and lost == []
    for rid in chosen:
        assert row(sessions, rid).claimed_by == "exec-1"
    with sessions() as s:  # requeue them for the race below
        queue.requeue_abandoned(s, "exec-1")
    # Eight claimants over the same requests in different orders (on PostgreSQL, rows locked in
    # any order by two claims would deadlock): each request is claimed once, whatever the interleaving.
    got: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def claim(i):
        order = list(ids)
        random.Random(i).shuffle(order)
        try:
            with sessions() as s:
                got[f"w{i}"] = [m.id for m in queue.claim_batch(s, order, f"w{i}")]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    claimed = [rid for won in got.values() for rid in won]
    assert sorted(claimed) == sorted(ids)  # every request once, none twice
    for worker, won in got.items():
        assert all(row(sessions, rid).claimed_by == worker for rid in won)
    with sessions() as s:  # the database is the module's: leave nothing running or queued
        for worker, won in got.items():
            for rid in won:
                assert queue.finish(s, rid, worker, error="claimed by the race test")


# -- fairness through the real queue -------------------------------------------------------------
@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_a_flooding_tenant_does_not_keep_another_out_of_the_batches(tmp_path, store, request):
    """Budget 100, equal weights. `flood` keeps 40 sampling requests of 45 tokens queued; `small`
    has one request of 10 queued at a time (its next arrives once it is served). Every batch holds
    small's request, and flood gets the rest of the budget (two of its 45s): a flood of large
    requests takes no more than its share from a tenant that asks for less."""
    _, sessions = connect(store_url(store, tmp_path, request))
    with sessions() as s:
        flood, _ = create_tenant(s, f"flood-{store}-{tmp_path.name}"[:64])
        small, _ = create_tenant(s, f"small-{store}-{tmp_path.name}"[:64])
    queue_samples(sessions, flood.id, f"ssf-{tmp_path.name}", [45] * 40)
    queue_samples(sessions, small.id, f"sss-{tmp_path.name}", [10])
    packer = Packer(100, lambda t: 1.0, 64)
    for _ in range(12):
        with sessions() as s:
            claim = packer.claim(s, "exec")
            tenants = [claim.heads[m.id].tenant for m in claim.members]
            assert sorted(tenants) == sorted([flood.name, flood.name, small.name]), tenants
            for m in claim.members:  # "executed": the batch's requests finish
                assert queue.finish(s, m.id, "exec", result=b"{}")
        packer.charge(claim, 1.0)
        queue_samples(sessions, small.id, f"sss-{tmp_path.name}", [10])
        queue_samples(sessions, flood.id, f"ssf-{tmp_path.name}", [45, 45])
    with sessions() as s:  # leave nothing queued in the module's database
        s.execute(update(Request).where(Request.state == RequestState.QUEUED.value)
                  .values(state=RequestState.FAILED.value))
        s.commit()


def test_the_operator_s_weights_set_each_tenant_s_share(tmp_path):
    """Weights 1 and 3, both tenants flooding 10-token requests, budget 100: shares of 25 and 75.
    heavy fills its share to 70 (an 80th token would pass it), light to 20 and then takes the last
    10 (what is left goes to the least served by weight: 20/1 < 70/3); equal weights would give
    50 and 50."""
    _, sessions = connect(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with sessions() as s:
        a, _ = create_tenant(s, "light")
        b, _ = create_tenant(s, "heavy")
    queue_samples(sessions, a.id, "ssa", [10] * 30)
    queue_samples(sessions, b.id, "ssb", [10] * 30)
    packer = Packer(100, {"light": 1.0, "heavy": 3.0}.__getitem__, 64)
    with sessions() as s:
        claim = packer.claim(s, "exec")
    tokens = {t: sum(h.cost for h in claim.heads.values() if h.tenant == t) for t in ("light", "heavy")}
    assert tokens == {"light": 30, "heavy": 70}, tokens


# -- failure isolation in the Executor -----------------------------------------------------------
@pytest.fixture()
def executor_and_api(tmp_path, builtin_dir):
    from lockstep.service.executor import RequestExecutor
    from lockstep.service.types import WorkerConfig

    with serving(tmp_path, builtin_dir) as (client, sessions, key_a, key_b):
        url = f"sqlite:///{tmp_path / 'db.sqlite'}"
        ex = RequestExecutor(WorkerConfig(db_url=url, storage_url=str(tmp_path / "storage"),
                                          home=str(tmp_path / "worker"), threads=1), "exec-test", os.getpid())
        yield ex, client, sessions, key_a, key_b


def drain(ex) -> None:
    """Run until nothing is claimable (each step claims and runs batches synchronously)."""
    while ex.step():
        pass


def post_fb(client, key, mid, seq_id, tokens):
    r = client.post("/api/v1/forward_backward", content=fwdbwd(mid, seq_id, tokens=tokens),
                    headers={"X-API-Key": key, "Content-Type": "application/x-protobuf"})
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def test_a_member_that_fails_inside_a_batch_fails_alone(executor_and_api, builtin_dir):
    """One batch of four forward_backward requests of four models (two tenants): alice's and bob's
    are valid; a row written behind the API's back holds a token id outside the vocabulary; the
    fourth's model cannot be rebuilt (its durable state is gone). The two valid ones get their
    results (bit for bit what their model computes alone) and advance their models; each bad one
    fails alone with a user error that says what is wrong."""
    from lockstep.engine.trainer import Trainer
    from lockstep.engine.types import Datum
    from lockstep.service.host import lora_spec

    ex, client, sessions, key_a, key_b = executor_and_api
    _, alice = new_model(client, key_a)
    _, bob = new_model(client, key_b)
    _, hostile = new_model(client, key_b)
    _, lost = new_model(client, key_a)
    drain(ex)
    good = {alice: post_fb(client, key_a, alice, 1, (5, 6, 7)), bob: post_fb(client, key_b, bob, 1, (9, 3, 4, 2))}
    with sessions() as s:
        bad_tokens = queue.submit(s, tenant_id=s.get(Model, hostile).tenant_id, kind=RequestKind.FORWARD_BACKWARD,
                                  payload=fwdbwd(hostile, 1, tokens=(5, 10**6, 7)), payload_format="proto",
                                  model_id=hostile, seq_id=1, num_tokens=3).id
        s.execute(update(Model).where(Model.id == lost).values(state_path="models/gone/state", state_seq=0))
        s.commit()
    ex.host.drop_model(lost)
    unbuildable = post_fb(client, key_a, lost, 1, (5, 6))
    with sessions() as s:
        claim = ex.packer.claim(s, ex.id)
    assert {m.id for m in claim.members} == {*good.values(), bad_tokens, unbuildable}  # one packed batch
    ex.run(claim)

    failed = row(sessions, bad_tokens)
    assert failed.state == "failed" and failed.error_category == "user"
    assert "outside the vocabulary" in failed.error and "1000000" in failed.error
    failed = row(sessions, unbuildable)
    assert failed.state == "failed" and failed.error_category == "user" and "no longer exist" in failed.error
    for mid, rid in good.items():
        done = row(sessions, rid)
        assert done.state == "done" and done.error is None, done.error
        alone = Trainer.from_pretrained(builtin_dir, lora=lora_spec({"rank": 4}))
        fb = wire.decode_forward_backward(fwdbwd(mid, 1, tokens=(5, 6, 7) if mid == alice else (9, 3, 4, 2)))
        out = alone.forward_backward([Datum(d.model_input, d.loss_fn_inputs) for d in fb.data], fb.loss_fn)
        assert done.result == wire.encode_forward_output(out.loss_fn_outputs, out.metrics)
    with sessions() as s:  # every model's order moved past its request, failed or not
        assert all(s.get(Model, m).done_seq == 1 for m in (alice, bob, hostile, lost))
    # The valid models trained on: their next request (an optim_step, alone) runs on their gradients.
    r = post(client, "optim_step", key_a, {"model_id": alice, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}})
    drain(ex)
    step = row(sessions, r.json()["request_id"])
    assert step.state == "done", step.error
    assert json.loads(step.result)["metrics"]["grad_norm:mean"] > 0


def test_an_invalid_member_is_refused_before_any_member_runs(executor_and_api):
    """host.run_batch checks every member first: with the bad one first in the batch, the valid
    one after it still runs (and its model's gradients hold only its own request)."""
    ex, client, sessions, key_a, key_b = executor_and_api
    _, alice = new_model(client, key_a)
    _, bob = new_model(client, key_b)
    drain(ex)
    from lockstep.service.types import BatchMember

    results = ex.host.run_batch("forward_backward", [BatchMember(bob, fwdbwd(bob, 1, tokens=(5, 10**6))),
                                                     BatchMember("no-such-model", fwdbwd(alice, 1)),
                                                     BatchMember(alice, fwdbwd(alice, 1))])
    assert "outside the vocabulary" in str(results[0]) and "not loaded" in str(results[1])
    body, tokens = results[2]
    assert tokens == 3 and isinstance(body, bytes)
    trainer = ex.host.trainers[bob]
    assert all(p.grad is None or not p.grad.any() for p in trainer.params.values())  # bob's bad member touched nothing
    assert any(p.grad is not None and p.grad.any() for p in ex.host.trainers[alice].params.values())
