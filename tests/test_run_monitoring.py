"""A real short run, watched: an alert rule on its step metrics reaches a webhook while it trains,
and its spans export as Chrome/Perfetto trace-event JSON (`lockstep trace`)."""

import json
import subprocess
import sys
import time

import pytest

from lockstep.config import load
from lockstep.monitor.alerts import Webhook, parse_rules, watch
from lockstep.runtime.run import run
from test_alerts import Receiver

SFT_STEPS, RL_STEPS = 2, 3


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory, builtin_dir):
    root = tmp_path_factory.mktemp("watched")
    receiver = Receiver()
    rules = parse_rules('[[rule]]\nname = "rl_started"\nmetric = "rollout/reward_mean"\ncondition = ">="\n'
                        'threshold = 0.0\nseverity = "info"\n')
    spec = load(None, [f"stages.0.steps={SFT_STEPS}", "stages.0.batch_size=8", "stages.0.eval_every=100",
                       "stages.0.target_accuracy=0.0", f"rl.steps={RL_STEPS}", "rl.prompts_per_step=2",
                       "rl.group_size=4", "rl.eval_every=100", "rl.max_seconds=0", "rl.max_staleness=1",
                       "env.num_heldout=8", "env.pass_k=0", f"model.path='{builtin_dir}'"])
    try:
        engine = watch(root / "run", rules, Webhook(receiver.url), every_s=0.2)
        run(spec, root / "run")
        deadline = time.time() + 10
        while not receiver.events and time.time() < deadline:
            time.sleep(0.1)
    finally:
        receiver.close()
    return root / "run", receiver.events, engine


def test_an_alert_reaches_the_webhook_while_the_run_trains(watched_run):
    run_dir, events, engine = watched_run
    assert [(e["rule"], e["status"]) for e in events] == [("rl_started", "firing")]
    assert events[0]["run_dir"] == str(run_dir) and engine.firing == {"rl_started"}
    assert [json.loads(x)["rule"] for x in (run_dir / "alerts.jsonl").read_text().splitlines()] == ["rl_started"]


def check_trace_events(trace: dict) -> None:
    """The trace-event format's JSON Object Format, as chrome://tracing and Perfetto read it."""
    assert isinstance(trace["traceEvents"], list) and trace["displayTimeUnit"] in ("ms", "ns")
    lanes: dict = {}
    for e in trace["traceEvents"]:
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["ph"] in ("X", "M"), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index") and isinstance(e["args"], dict)
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in lanes.values():  # complete events of one thread nest or follow each other
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert b0 >= a1 or b1 <= a1, (a0, a1, b0, b1)


def test_the_runs_spans_export_as_a_perfetto_trace(watched_run, tmp_path):
    run_dir, _, _ = watched_run
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "trace", str(run_dir), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    trace = json.loads(out.read_text())
    check_trace_events(trace)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_track = {}
    for e in spans:
        by_track.setdefault(names[e["tid"]].split(" #")[0], []).append(e)
    assert {"generator", "environments", "trainer", "weights", "evaluation"} <= set(by_track)
    assert [e["args"]["step"] for e in by_track["trainer"] if e["name"] == "train"] == list(range(1, RL_STEPS + 1))
    assert len([e for e in by_track["trainer"] if e["name"] == "sft step"]) == SFT_STEPS
    assert len(by_track["generator"]) >= RL_STEPS and all(e["args"]["groups"] == 2 for e in by_track["generator"])
    assert len(by_track["weights"]) >= SFT_STEPS + RL_STEPS  # a publication after every step
    assert "#" in "".join(names.values())  # with staleness 1, two rollout batches overlap: two generator lanes


def test_trace_of_a_directory_that_is_no_run_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "trace", str(tmp_path), "-o", str(tmp_path / "t.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no trace.jsonl there" in proc.stdout + proc.stderr


def test_the_report_has_the_pipeline_timeline_and_the_final_tables(watched_run):
    run_dir, _, _ = watched_run
    page = (run_dir / "report.html").read_text()
    assert 'alt="pipeline timeline"' in page and "<h2>Ledger and filters (whole run)</h2>" in page
    ledger = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    trained = sum(len(e["ids"]) for e in ledger if e.get("event") == "trained")
    assert f"<tr><th>groups trained</th><td>{trained}</td></tr>" in page and trained == RL_STEPS * 2
    assert "data:image/png;base64," in page and "http://" not in page and "https://" not in page  # one file
