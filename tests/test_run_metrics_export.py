"""`lockstep run --metrics-port`: a run's step metrics for Prometheus, read from its metrics.jsonl
while the run writes it (monitor/prometheus.py)."""

import json
import socket
import subprocess
import sys

import httpx
from helpers import free_port
from prometheus_client.parser import text_string_to_metric_families

from lockstep.monitor.metrics import MetricsLogger
from lockstep.monitor.prometheus import metric_name, serve_run_metrics


def scrape(port) -> dict:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_names_follow_prometheus_conventions():
    assert metric_name("rollout/reward_mean") == "lockstep_run_rollout_reward_mean"
    assert metric_name("time/step_s") == "lockstep_run_time_step_seconds"
    assert metric_name("staleness/0") == "lockstep_run_staleness_0"
    assert metric_name("mismatch/abs") == "lockstep_run_mismatch_abs"


def test_the_latest_step_is_served_while_the_run_writes(tmp_path):
    port = free_port()
    server = serve_run_metrics(tmp_path, port)
    try:
        assert scrape(port)["lockstep_run_step"] == 0  # no metrics.jsonl yet: nothing to say, no error
        log = MetricsLogger(tmp_path, tensorboard=False)
        log.log(1, {"rollout/reward_mean": 0.25, "time/step_s": 1.5, "eval/stage": "rl", "flag": True})
        log.log(2, {"rollout/reward_mean": 0.5, "loss/kl": float("nan")})
        m = scrape(port)
        assert m["lockstep_run_step"] == 2 and m["lockstep_run_records_total"] == 2
        assert m["lockstep_run_rollout_reward_mean"] == 0.5 and m["lockstep_run_time_step_seconds"] == 1.5
        assert not any("stage" in k or "flag" in k or "kl" in k for k in m)  # only finite numbers
        with open(tmp_path / "metrics.jsonl", "a") as f:  # a record half written
            f.write(json.dumps({"step": 3, "rollout/reward_mean": 0.75})[:20])
        assert scrape(port)["lockstep_run_step"] == 2
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 3, "rollout/reward_mean": 0.75})[20:] + "\n")
        assert scrape(port)["lockstep_run_rollout_reward_mean"] == 0.75
        log.close()
        MetricsLogger(tmp_path, tensorboard=False, keep_through=1).close()  # a resume rewrites the file
        m = scrape(port)
        assert m["lockstep_run_step"] == 1 and m["lockstep_run_records_total"] == 1
        assert m["lockstep_run_rollout_reward_mean"] == 0.25
    finally:
        server.shutdown()


def test_a_port_that_cannot_be_used_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for bad, says in ((str(port), "cannot listen there"), ("70000", "expected a TCP port")):
            proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "run", "--run-dir", str(tmp_path / "r"),
                                   "--metrics-port", bad], capture_output=True, text=True, timeout=120)
            assert proc.returncode != 0 and says in proc.stdout + proc.stderr, proc.stdout + proc.stderr
