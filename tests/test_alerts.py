"""Alert rules (monitor/alerts.py): parsed with errors that name the rule and the field, evaluated
over metrics.jsonl as a run writes it, and delivered to a webhook that may be slow, failing or down
without ever blocking the run."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lockstep.monitor.alerts import AlertConfigError, AlertEngine, Webhook, load_rules, parse_rules
from lockstep.monitor.metrics import MetricsLogger


class Receiver:
    """A local webhook receiver: records each JSON body; answers `fail_first` requests with 500.
    With `hold`, each request sets `entered` and waits on `hold` before answering (60 s at most, so
    that a sender that waits on it ends up failing the test rather than hanging it)."""

    def __init__(self, fail_first: int = 0, hold: threading.Event | None = None):
        self.events, self.calls, self.fail_first, self.answered = [], 0, fail_first, 0
        self.hold, self.entered = hold, threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.calls += 1
                if outer.hold is not None:
                    outer.entered.set()
                    outer.hold.wait(60)
                if outer.calls <= outer.fail_first:
                    self.send_response(500)
                else:
                    outer.events.append(json.loads(body))
                    self.send_response(204)
                self.end_headers()
                outer.answered += 1

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_the_shipped_rules_load():
    names = {r.name for r in load_rules()}
    assert names == {"reward_collapse", "mismatch_high", "staleness_saturated", "no_progress", "env_errors"}


@pytest.mark.parametrize("text,says", [
    ('[[rule]]\nname="a"\nmetric="x"\ncondition=">"\nthreshhold=1', "rule 0 ('a'): unknown field 'threshhold'"),
    ('[[rule]]\nname="a"\nmetric="x"\ncondition="above"', "rule 0 ('a'): field 'condition' must be one of"),
    ('[[rule]]\nname="a"\ncondition=">"', "rule 0 ('a'): field 'metric' is required"),
    ('[[rule]]\nname="a"\nmetric="x"\ncondition=">"\nfor_s=-1', "field 'for_s' must be >= 0"),
    ('[[rule]]\nname="a"\nmetric="x"\ncondition=">"\nthreshold="high"', "field 'threshold' must be a finite number"),
    ('[[rule]]\nname="a"\nmetric="x"\ncondition=">"\nseverity="page"', "field 'severity' must be one of"),
    ('[[rule]]\nname="a"\nmetric="x"\ncondition="unchanged"', "field 'for_s' must be > 0 for the 'unchanged'"),
    ('[[rule]]\nname="a"\nmetric="x"\ncondition=">"\n[[rule]]\nname="a"\nmetric="y"\ncondition="<"', "two rules are named 'a'"),
    ('[rules]\nname="a"', "unknown top-level key(s) ['rules']"),
    ('[[rule]\nname="a"', "invalid TOML"),
])
def test_a_malformed_rule_is_an_error_naming_the_rule_and_the_field(text, says):
    with pytest.raises(AlertConfigError) as e:
        parse_rules(text, "rules.toml")
    assert says in str(e.value) and str(e.value).startswith("rules.toml")


def test_rules_fire_after_their_duration_and_resolve(tmp_path):
    rules = parse_rules('''
[[rule]]
name = "loss_high"
metric = "train/loss"
condition = ">"
threshold = 1.0
for_s = 30
[[rule]]
name = "collapse"
metric = "rollout/reward_mean"
condition = "below_peak_fraction"
threshold = 0.5
[[rule]]
name = "stalled"
metric = "step"
condition = "unchanged"
for_s = 60
severity = "critical"
''')
    clock, log = Clock(), MetricsLogger(tmp_path, tensorboard=False)
    engine = AlertEngine(tmp_path, rules, clock=clock)
    log.log(1, {"train/loss": 2.0, "rollout/reward_mean": 0.2})
    assert engine.check() == []  # loss pending, not yet for 30 s
    clock.t += 20
    log.log(2, {"train/loss": 1.5, "rollout/reward_mean": 0.8})
    assert engine.check() == []
    clock.t += 15
    log.log(3, {"train/loss": 1.2, "rollout/reward_mean": 0.3})  # under half the peak of 0.8
    fired = engine.check()
    assert [(e["rule"], e["status"], e["value"]) for e in fired] == [("loss_high", "firing", 1.2), ("collapse", "firing", 0.3)]
    assert fired[0]["step"] == 3 and fired[0]["severity"] == "warning"
    clock.t += 5
    log.log(4, {"train/loss": 0.5, "rollout/reward_mean": 0.7})
    assert [(e["rule"], e["status"]) for e in engine.check()] == [("loss_high", "resolved"), ("collapse", "resolved")]
    clock.t += 61  # no new step for a minute
    assert [(e["rule"], e["status"], e["severity"]) for e in engine.check()] == [("stalled", "firing", "critical")]
    log.log(5, {"train/loss": 0.5})
    assert [(e["rule"], e["status"]) for e in engine.check()] == [("stalled", "resolved")]
    written = [json.loads(line) for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert [(e["rule"], e["status"]) for e in written] == [("loss_high", "firing"), ("collapse", "firing"),
                                                          ("loss_high", "resolved"), ("collapse", "resolved"),
                                                          ("stalled", "firing"), ("stalled", "resolved")]


def test_the_webhook_gets_events_and_retries_failures():
    receiver = Receiver(fail_first=2)
    try:
        hook = Webhook(receiver.url, backoff_s=0.05)
        hook.send({"status": "firing", "rule": "r", "value": 1.0})
        assert hook.join(10)
        assert receiver.calls == 3 and receiver.events == [{"status": "firing", "rule": "r", "value": 1.0}]
        assert hook.sent == 1 and hook.failed == 0
    finally:
        receiver.close()


def test_a_webhook_that_hangs_never_blocks_and_a_full_queue_drops():
    """send() never waits on the receiver: all six calls return while the receiver is provably still
    inside the first request, blocked on an Event this test holds; past one in delivery and two
    queued, events are dropped and counted."""
    gate = threading.Event()
    receiver = Receiver(hold=gate)
    try:
        hook = Webhook(receiver.url, max_queue=2, retries=0)
        hook.send({"status": "firing", "rule": "r0"})
        assert receiver.entered.wait(60), "the first event never reached the receiver"
        for i in range(1, 6):
            hook.send({"status": "firing", "rule": f"r{i}"})
        # Had a send() waited on the receiver, the receiver would have answered by now (its wait ends).
        assert receiver.answered == 0 and not gate.is_set()
        assert hook.dropped == 3 and hook.sent == 0  # one in delivery, two queued, three dropped
        gate.set()
        assert hook.join(30)
        assert [e["rule"] for e in receiver.events] == ["r0", "r1", "r2"] and hook.sent == 3
    finally:
        gate.set()
        receiver.close()
    with pytest.raises(AlertConfigError, match="expected an http"):
        Webhook("file:///etc/passwd")


def test_the_cli_refuses_a_malformed_rule_file(tmp_path):
    bad = tmp_path / "rules.toml"
    bad.write_text('[[rule]]\nname = "x"\nmetric = "step"\ncondition = "unchanged"\n')
    proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "run", "--run-dir", str(tmp_path / "r"), "--alerts",
                           str(bad)], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "rule 0 ('x'): field 'for_s' must be > 0" in out, out
