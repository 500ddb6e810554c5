"""GET /metrics (service/prometheus.py): the service in Prometheus' format, for the operator only.

The store's numbers are checked against rows written here as a worker would write them (claimed,
finished at known times), on SQLite and PostgreSQL (the latency is computed in SQL, per dialect)."""

import datetime as dt
import json
import re
import uuid

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from lockstep.service.app import ServiceConfig, create_app
from lockstep.service.db import Endpoint, Usage, connect, now
from lockstep.service.db import Request as RequestRow
from lockstep.service.tenants import create_tenant
from test_service_backends import postgres_url  # noqa: F401 - a fixture

TOKEN = "operator-" + uuid.uuid4().hex


def scrape(client, token=TOKEN) -> dict:
    r = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST  # the text exposition format
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def serve_in_thread(app) -> tuple[int, object]:
    """(port, uvicorn server) for `app` served from a daemon thread, once it is up."""
    import threading
    import time

    import uvicorn

    from helpers import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    return port, server


def _row(tenant_id, kind, state, order, *, queued_s=None, took_s=None, worker=None):
    t0 = now().replace(microsecond=0) - dt.timedelta(hours=1)
    return RequestRow(id=uuid.uuid4().hex, tenant_id=tenant_id, kind=kind, payload=b"{}", payload_sha="0" * 64,
                      state=state, order=order, created_at=t0, claimed_by=worker,
                      claimed_at=t0 + dt.timedelta(seconds=queued_s) if queued_s is not None else None,
                      finished_at=t0 + dt.timedelta(seconds=took_s) if took_s is not None else None)


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_metrics_report_the_queue_latency_workers_and_usage(tmp_path, store, request):
    url = request.getfixturevalue("postgres_url") if store == "postgres" else f"sqlite:///{tmp_path / 'db.sqlite'}"
    _, sessions = connect(url)
    suffix = uuid.uuid4().hex[:8]
    with sessions() as s:
        alice, key = create_tenant(s, f"alice-{suffix}")
        s.add_all([
            _row(alice.id, "sample", "queued", 1),
            _row(alice.id, "sample", "running", 2, queued_s=0.2, worker=f"w-{suffix}"),
            _row(alice.id, "sample", "done", 3, queued_s=0.3, took_s=0.75, worker=f"w-{suffix}"),
            _row(alice.id, "sample", "done", 4, queued_s=0.02, took_s=2.0, worker=f"w-{suffix}"),
            _row(alice.id, "forward_backward", "failed", 5, queued_s=1.0, took_s=40.0, worker=f"w-{suffix}"),
            Usage(tenant_id=alice.id, kind="sampled_tokens", amount=100.0),
            Usage(tenant_id=alice.id, kind="sampled_tokens", amount=28.0),
            Endpoint(id=f"w-{suffix}", role="worker", host="127.0.0.1", port=1),
        ])
        s.commit()
    with TestClient(create_app(ServiceConfig(db_url=url, storage_url=str(tmp_path / "storage"),
                                             operator_token=TOKEN))) as client:
        client.post("/api/v1/create_session", headers={"X-API-Key": key}, json={})
        client.get("/v1/jobs/j-unknown", headers={"X-API-Key": key})
        client.get("/no/such/route")
        client.get("/v1/datasets", headers={"X-API-Key": key})
        m = scrape(client)
    assert m["lockstep_requests_in_flight", (("kind", "sample"), ("state", "queued"))] == 1
    assert m["lockstep_requests_in_flight", (("kind", "sample"), ("state", "running"))] == 1
    assert m["lockstep_requests_completed_total", (("kind", "sample"), ("state", "done"))] == 2
    assert m["lockstep_requests_completed_total", (("kind", "forward_backward"), ("state", "failed"))] == 1
    total = "lockstep_request_duration_seconds"
    assert m[f"{total}_bucket", (("kind", "sample"), ("le", "0.5"))] == 0
    assert m[f"{total}_bucket", (("kind", "sample"), ("le", "1.0"))] == 1
    assert m[f"{total}_bucket", (("kind", "sample"), ("le", "2.5"))] == 2
    assert m[f"{total}_count", (("kind", "sample"),)] == 2
    assert m[f"{total}_sum", (("kind", "sample"),)] == pytest.approx(2.75, abs=1e-3)
    assert m[f"{total}_bucket", (("kind", "forward_backward"), ("le", "30.0"))] == 0
    assert m[f"{total}_bucket", (("kind", "forward_backward"), ("le", "60.0"))] == 1
    wait = "lockstep_request_queue_wait_seconds"
    assert m[f"{wait}_bucket", (("kind", "sample"), ("le", "0.025"))] == 1  # the running one is not counted
    assert m[f"{wait}_sum", (("kind", "sample"),)] == pytest.approx(0.32, abs=1e-3)
    assert m["lockstep_workers", ()] == 1 and m["lockstep_workers_busy", ()] == 1
    assert m["lockstep_tenant_usage_total", (("kind", "sampled_tokens"), ("tenant", f"alice-{suffix}"))] == 128.0
    http = "lockstep_http_requests_total"
    assert m[http, (("method", "POST"), ("route", "/api/v1/create_session"), ("status", "200"))] == 1
    assert m[http, (("method", "GET"), ("route", "/v1/jobs/{job_id}"), ("status", "404"))] == 1
    assert m[http, (("method", "GET"), ("route", "unmatched"), ("status", "404"))] == 1  # no raw path as a label
    assert m[http, (("method", "GET"), ("route", "/v1/datasets"), ("status", "200"))] == 1
    assert m["lockstep_http_request_duration_seconds_count", (("method", "POST"), ("route", "/api/v1/create_session"))] == 1


def test_every_route_is_labelled_with_its_full_path_template(tmp_path):
    app = create_app(ServiceConfig(db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", storage_url=str(tmp_path / "s")))
    labels = {re.sub(r"\{(\w+):\w+\}", r"{\1}", v) for v in app.state.metrics._route_names.values()}  # {id:path}
    assert set(app.openapi()["paths"]) <= labels


def test_metrics_are_the_operators_only(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    _, sessions = connect(url)
    with sessions() as s:
        _, key = create_tenant(s, "alice")
    with TestClient(create_app(ServiceConfig(db_url=url, storage_url=str(tmp_path / "s"), operator_token=TOKEN))) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}, {"X-API-Key": key},
                        {"Authorization": f"Bearer {TOKEN}x"}):
            r = c.get("/metrics", headers=headers)
            assert r.status_code == 401 and "operator's token" in r.json()["error"], headers
        scrape(c)
    with TestClient(create_app(ServiceConfig(db_url=url, storage_url=str(tmp_path / "s")))) as c:
        r = c.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 404 and "LOCKSTEP_OPERATOR_TOKEN" in r.json()["error"]


def test_the_trace_holds_the_callers_requests_only(tmp_path):
    from test_run_monitoring import check_trace_events

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    _, sessions = connect(url)
    with sessions() as s:
        alice, key_a = create_tenant(s, "alice")
        bob, key_b = create_tenant(s, "bob")
        s.add_all([_row(alice.id, "sample", "done", 1, queued_s=0.5, took_s=2.0, worker="w1"),
                   _row(alice.id, "forward_backward", "running", 2, queued_s=1.0, worker="w2"),
                   _row(alice.id, "optim_step", "queued", 3),
                   _row(bob.id, "sample", "done", 4, queued_s=0.1, took_s=0.3, worker="w1")])
        s.commit()
    with TestClient(create_app(ServiceConfig(db_url=url, storage_url=str(tmp_path / "s")))) as c:
        r = c.get("/v1/trace", headers={"X-API-Key": key_a})
        assert r.status_code == 200
        trace = r.json()
        check_trace_events(trace)
        names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        spans = [(e["name"], names[e["tid"]].split(" #")[0], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X"]
        assert sorted((n, t) for n, t, _ in spans) == sorted([
            ("queued sample", "queue"), ("sample", "worker w1"), ("queued forward_backward", "queue"),
            ("forward_backward", "worker w2"), ("queued optim_step", "queue")])
        assert [d for n, t, d in spans if n == "sample"] == [1.5e6]  # claimed at 0.5 s, finished at 2 s
        bob_trace = c.get("/v1/trace", headers={"X-API-Key": key_b}).json()
        assert [e["name"] for e in bob_trace["traceEvents"] if e["ph"] == "X"] == ["queued sample", "sample"]
        assert c.get("/v1/trace").status_code == 401
        assert c.get("/v1/trace?limit=0", headers={"X-API-Key": key_a}).status_code == 400
        assert len([e for e in c.get("/v1/trace?limit=1", headers={"X-API-Key": key_a}).json()["traceEvents"]
                    if e["ph"] == "X"]) == 1  # the newest: the queued optim_step


def test_stats_give_the_callers_latency_percentiles_and_nothing_of_others(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    _, sessions = connect(url)
    with sessions() as s:
        alice, key_a = create_tenant(s, "alice")
        bob, key_b = create_tenant(s, "bob")
        # alice: 100 finished samples taking 1..100 s (queue wait a tenth of it), one running, one queued
        s.add_all([_row(alice.id, "sample", "done", i, queued_s=i / 10, took_s=float(i), worker="w1") for i in range(1, 101)])
        s.add_all([_row(alice.id, "forward_backward", "running", 101, queued_s=1.0, worker="w1"),
                   _row(alice.id, "sample", "queued", 102), _row(bob.id, "sample", "done", 103, queued_s=9.0, took_s=999.0)])
        s.add(Endpoint(id="w1", role="worker", host="127.0.0.1", port=1))
        s.commit()
    with TestClient(create_app(ServiceConfig(db_url=url, storage_url=str(tmp_path / "s")))) as c:
        a = c.get("/v1/stats", headers={"X-API-Key": key_a}).json()
        b = c.get("/v1/stats", headers={"X-API-Key": key_b}).json()
        assert c.get("/v1/stats").status_code == 401
    assert a["latency"]["sample"]["count"] == 100
    assert a["latency"]["sample"]["total_s"] == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert a["latency"]["sample"]["queue_wait_s"] == {"p50": 5.0, "p90": 9.0, "p99": 9.9}
    assert a["requests_in_flight"] == {"forward_backward/running": 1, "sample/queued": 1} and a["queued"] == 1
    assert a["workers"] == {"live": 1, "busy": 1}
    assert b["latency"]["sample"]["total_s"]["p99"] == 999.0 and b["requests_in_flight"] == {}  # bob's own only


def test_the_service_page_shows_the_callers_share_in_a_browser(tmp_path):
    from test_dashboard import _browser, wait_for

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    _, sessions = connect(url)
    with sessions() as s:
        alice, key = create_tenant(s, "alice")
        s.add_all([_row(alice.id, "sample", "done", i, queued_s=i / 10, took_s=float(i), worker="w1") for i in range(1, 101)])
        s.add(Endpoint(id="w1", role="worker", host="127.0.0.1", port=1))
        s.commit()
    port, server = serve_in_thread(create_app(ServiceConfig(db_url=url, storage_url=str(tmp_path / "s"))))
    driver = _browser()
    expected = ["sample", "100", "50", "90", "99", "5", "9", "9.900"]

    def cells():  # the panel redraws itself: read it whole, again until it shows what the store holds
        return [td.text for td in driver.find_elements("css selector", "#latency-sample td")]

    def service_rows():
        return {tr.find_element("tag name", "th").text: tr.find_element("tag name", "td").text
                for tr in driver.find_elements("css selector", "#service tr")}

    try:
        driver.get(f"http://127.0.0.1:{port}/ui")
        driver.find_element("id", "key").send_keys("wrong key")
        driver.find_element("css selector", "#signin button").click()
        wait_for(lambda: "unknown API key" in driver.find_element("id", "error").text, "the wrong key refused")
        driver.find_element("id", "key").clear()
        driver.find_element("id", "key").send_keys(key)
        driver.find_element("css selector", "#signin button").click()
        try:
            wait_for(lambda: cells() == expected, "the caller's latency row", timeout=60)
        except AssertionError:
            raise AssertionError(f"the latency row shows {cells()}, not {expected}") from None
        rows = wait_for(lambda: (r := service_rows()).get("workers live") and r, "the service panel", timeout=60)
        assert rows["workers live"] == "1" and rows["requests queued"] == "0"
        assert "alice" in driver.find_element("id", "tenant").text
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]
                  and "/v1/operator/overview" not in e["message"]]
        assert errors == [], errors  # (the wrong key's 401, and the page then trying it as the operator's token
        # on a server without one, a 404, are logged as failed loads: expected)
    finally:
        driver.quit()
        server.should_exit = True


def test_the_service_health_record_and_its_shipped_rules(tmp_path):
    from lockstep.monitor.alerts import SERVICE_RULES, AlertEngine, load_rules
    from lockstep.service.db import Job
    from lockstep.service.service_metrics import service_record

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    _, sessions = connect(url)
    recent = now() - dt.timedelta(seconds=30)
    with sessions() as s:
        alice, _ = create_tenant(s, "alice")
        rows = [_row(alice.id, "sample", "done" if i % 4 else "failed", i, queued_s=0.1, took_s=0.5) for i in range(1, 9)]
        for r in rows:
            r.created_at = recent
            r.claimed_at, r.finished_at = recent + dt.timedelta(seconds=0.1), recent + dt.timedelta(seconds=0.5)
        s.add_all([*rows, _row(alice.id, "sample", "queued", 9)])
        s.add(Job(id="a" * 16, tenant_id=alice.id, name="j", spec={}, state="running", attempts=3))
        s.commit()
    record = service_record(sessions)
    assert record["requests/error_rate"] == 0.25 and record["requests/finished_last_5m"] == 8
    assert record["requests/queued"] == 1 and record["jobs/max_attempts"] == 3 and record["workers/live"] == 0
    clock = Clock()
    engine = AlertEngine(tmp_path / "alerts", load_rules(None, default=SERVICE_RULES), clock=clock)
    (tmp_path / "alerts").mkdir()
    assert {e["rule"] for e in engine.check([record])} == {"job_retried_too_often"}
    clock.t += 61
    assert {e["rule"] for e in engine.check([record])} == {"no_workers"}
    clock.t += 240
    assert {e["rule"] for e in engine.check([record])} == {"error_rate"}


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_serve_posts_its_alerts_to_a_webhook(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import free_port
    from test_alerts import Receiver

    receiver = Receiver()
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "no_workers_now"\nmetric = "workers/live"\ncondition = "<"\nthreshold = 1\n'
                     'severity = "critical"\n')
    env = {**os.environ, "LOCKSTEP_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", "--no-worker", "--port", str(free_port()),
                             "--db", f"sqlite:///{tmp_path / 'db.sqlite'}", "--storage", str(tmp_path / "storage"),
                             "--alerts", str(rules), "--alert-webhook", receiver.url],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 60
        while not receiver.events and time.time() < deadline:
            time.sleep(0.2)
        assert [(e["rule"], e["status"], e["value"]) for e in receiver.events] == [("no_workers_now", "firing", 0.0)]
        written = (tmp_path / "home" / "service" / "alerts.jsonl").read_text().splitlines()
        assert [json.loads(x)["rule"] for x in written] == ["no_workers_now"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        receiver.close()
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rule]]\nname = "x"\nmetric = "workers/live"\ncondition = "below"\n')
    out = subprocess.run([sys.executable, "-m", "lockstep.cli", "serve", "--no-worker", "--alerts", str(bad)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "rule 0 ('x'): field 'condition' must be one of" in out.stdout + out.stderr


def test_the_operator_sees_every_tenant_and_only_with_its_token(tmp_path):
    import time

    from lockstep.service.db import Job, JobEvent
    from test_dashboard import _browser

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    _, sessions = connect(url)
    with sessions() as s:
        alice, key_a = create_tenant(s, "alice")
        bob, key_b = create_tenant(s, "bob")
        s.add_all([Job(id="a" * 16, tenant_id=alice.id, name="alices", spec={}, state="running", attempts=1),
                   Job(id="b" * 16, tenant_id=bob.id, name="bobs", spec={}, state="failed", attempts=3),
                   _row(bob.id, "sample", "queued", 1), Usage(tenant_id=alice.id, kind="tokens_sampled", amount=64.0)])
        s.add(JobEvent(job_id="a" * 16, kind="metrics", data={"step": 7, "rollout/reward_mean": 0.5}))
        s.commit()
    app = create_app(ServiceConfig(db_url=url, storage_url=str(tmp_path / "s"), operator_token=TOKEN))
    with TestClient(app) as c:
        o = c.get("/v1/operator/overview", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert [t["tenant"] for t in o["tenants"]] == ["alice", "bob"]
        assert o["tenants"][1]["jobs"] == {"failed": 1} and o["tenants"][1]["requests_in_flight"] == {"queued": 1}
        assert o["tenants"][0]["usage"] == {"tokens_sampled": 64.0}
        assert {(j["tenant"], j["name"]) for j in o["jobs"]} == {("alice", "alices"), ("bob", "bobs")}
        assert next(j for j in o["jobs"] if j["name"] == "alices")["latest"] == {"step": 7, "rollout/reward_mean": 0.5}
        assert o["health"]["requests/queued"] == 1 and o["alerts"] == []
        for headers in ({"Authorization": f"Bearer {key_a}"}, {"X-API-Key": key_a}, {}):
            assert c.get("/v1/operator/overview", headers=headers).status_code == 401
        assert c.get("/v1/jobs", headers={"X-API-Key": TOKEN}).status_code == 401  # the token is no tenant key
    with TestClient(create_app(ServiceConfig(db_url=url, storage_url=str(tmp_path / "s")))) as c:
        assert c.get("/v1/operator/overview", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
    port, server = serve_in_thread(create_app(ServiceConfig(db_url=url, storage_url=str(tmp_path / "s"),
                                                            operator_token=TOKEN)))  # a fresh app: that one has run
    driver = _browser()
    try:
        driver.get(f"http://127.0.0.1:{port}/ui")
        driver.find_element("id", "key").send_keys(TOKEN)
        driver.find_element("css selector", "#signin button").click()
        deadline = time.time() + 20
        while not driver.find_elements("id", "tenant-bob") and time.time() < deadline:
            time.sleep(0.1)
        assert driver.find_elements("id", "tenant-alice") and driver.find_elements("id", "job-" + "b" * 16)
        assert "operator" in driver.find_element("id", "tenant").text
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
        assert errors == [], errors  # (trying the token as a tenant key first logs a 401: expected)
    finally:
        driver.quit()
        server.should_exit = True
