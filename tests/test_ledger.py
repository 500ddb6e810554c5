"""The exactly-once ledger: transitions, commit/restore, and the audit of a killed-and-resumed run."""

import pytest

from lockstep.runtime.ledger import Ledger, LedgerError, audit


def through_reward(led, ids):
    led.issue(ids)
    led.generated(ids, 1.0)
    led.rewarded(ids, 2.0)


def test_transitions_are_enforced():
    led = Ledger()
    through_reward(led, ["a", "b"])
    led.trained(["a"], 1)
    with pytest.raises(LedgerError, match="trained -> trained"):
        led.trained(["a"], 2)  # never twice
    with pytest.raises(LedgerError, match="new -> trained"):
        led.trained(["c"], 2)  # never without a reward
    with pytest.raises(LedgerError, match="trained -> issued"):
        led.issue(["a"])
    led.requeue(["b"], "stale")
    assert led.replay == ["b"] and led.pending() == ["b"]
    through_reward(led, ["b"])
    led.filtered(["b"], "zero_variance")
    assert led.attempts == {"a": 1, "b": 2} and led.pending() == [] and led.replay == []
    assert led.counts()["trained"] == 1 and led.counts()["filtered"] == 1


def test_snapshot_restores_pending_as_replays_in_order():
    led = Ledger()
    through_reward(led, ["a", "b", "c"])
    led.trained(["a"], 1)
    led.requeue(["c"], "stale")
    led.issue(["d"])
    snap = led.snapshot()
    assert snap["pending"] == ["c", "b", "d"]  # queued replays first, then in-flight in issue order
    back = Ledger.restore(snap)
    assert back.replay == ["c", "b", "d"] and back.trained_step == {"a": 1}
    back.issue(["c", "b", "d"])  # replayed groups may be issued again, trained ones may not
    with pytest.raises(LedgerError):
        back.issue(["a"])


def test_audit_rolls_back_to_the_checkpoint_a_resume_names(tmp_path):
    log = tmp_path / "ledger.jsonl"
    led = Ledger(log)
    through_reward(led, ["a", "b"])
    led.trained(["a"], 1)
    snap = led.checkpoint("step-1")
    led.trained(["b"], 2)  # lost with the kill: the weights of step 2 were never committed
    led.close()
    resumed = Ledger.restore(snap, log, resumed_from="step-1")
    through_reward(resumed, ["b"])
    resumed.trained(["b"], 2)
    resumed.close()
    final = audit(log)
    assert final.trained_step == {"a": 1, "b": 2} and final.pending() == []
    assert final.attempts["b"] == 2


def test_audit_catches_a_group_trained_twice(tmp_path):
    log = tmp_path / "ledger.jsonl"
    led = Ledger(log)
    through_reward(led, ["a"])
    led.trained(["a"], 1)
    snap = led.checkpoint("step-1")
    led.close()
    bad = Ledger.restore({**snap, "trained": {}, "pending": ["a"]}, log, resumed_from="step-1")
    through_reward(bad, ["a"])  # a resume that forgot "a" was trained would train it again
    bad.trained(["a"], 2)
    bad.close()
    with pytest.raises(LedgerError, match="trained -> issued"):
        audit(log)


def test_audit_refuses_a_resume_from_an_unlogged_checkpoint(tmp_path):
    log = tmp_path / "ledger.jsonl"
    Ledger.restore({"trained": {}, "filtered": {}, "pending": []}, log, resumed_from="step-9").close()
    with pytest.raises(LedgerError, match="never checkpointed"):
        audit(log)
