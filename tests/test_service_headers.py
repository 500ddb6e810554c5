"""What every answer of the API says about itself, and what `lockstep serve` reads of a request's
head: the /ui pages run under a Content-Security-Policy that lets only their own scripts run (and
they work under it, in a real browser), nothing of ours may be framed or sniffed, and a request
head over the cap is a 431 while the server goes on serving."""

import base64
import hashlib
import json
import re
import socket
import threading
import uuid

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from lockstep.service import http_head
from lockstep.service.app import API_CSP, ServiceConfig, create_app
from lockstep.service.db import Job, JobEvent, connect
from lockstep.service.tenants import create_tenant
from lockstep.service.ui import INLINE_SCRIPT
from test_dashboard import _browser, wait_for
from test_service_metrics import serve_in_thread
from test_service_sdk import make_server


@pytest.fixture()
def world(tmp_path):
    """The API (no worker) on a store where alice has a job with five steps of metrics."""
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    _, sessions = connect(db)
    with sessions() as s:
        tenant, key = create_tenant(s, "alice")
        job = Job(id=uuid.uuid4().hex[:16], tenant_id=tenant.id, name="watched", spec={}, state="running")
        s.add(job)
        s.add_all([JobEvent(job_id=job.id, kind="metrics", data={"step": k, "rollout/reward_mean": k / 10})
                   for k in range(1, 6)])
        s.commit()
    app = create_app(ServiceConfig(db_url=db, storage_url=str(tmp_path / "storage")))
    return app, key, job.id


def directives(csp: str) -> dict[str, list[str]]:
    return {d.split()[0]: d.split()[1:] for d in csp.split(";") if d.strip()}


def test_every_answer_forbids_framing_and_sniffing_and_pages_allow_only_their_own_scripts(world):
    app, key, job_id = world
    with TestClient(app) as c:
        answers = {path: c.get(path, headers={"X-API-Key": key}) for path in (
            "/ui", f"/ui/jobs/{job_id}", "/static/plotly.min.js", "/v1/health", f"/v1/jobs/{job_id}", "/v1/jobs/nope",
            "/openapi.json", "/no/such/route")}
        answers["unauthorised"] = c.get("/v1/jobs")
    assert {p: r.status_code for p, r in answers.items()} == {
        "/ui": 200, f"/ui/jobs/{job_id}": 200, "/static/plotly.min.js": 200, "/v1/health": 200,
        f"/v1/jobs/{job_id}": 200, "/v1/jobs/nope": 404, "/openapi.json": 200, "/no/such/route": 404, "unauthorised": 401}
    for path, r in answers.items():
        assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff", path
        assert directives(r.headers["content-security-policy"])["frame-ancestors"] == ["'none'"], path
    for path in ("/v1/health", "/v1/jobs/nope", "/static/plotly.min.js"):  # not pages: nothing may run from them
        assert answers[path].headers["content-security-policy"] == API_CSP
    for path in ("/ui", f"/ui/jobs/{job_id}"):
        page = answers[path]
        scripts = directives(page.headers["content-security-policy"])["script-src"]
        assert "'unsafe-inline'" not in scripts and "'unsafe-eval'" not in scripts
        [inline] = INLINE_SCRIPT.findall(page.text)  # the page's one inline script, allowed by its hash alone
        assert scripts == ["'self'", f"'sha256-{base64.b64encode(hashlib.sha256(inline.encode()).digest()).decode()}'"]


def test_the_pages_work_under_their_policy_in_a_browser_and_an_injected_script_does_not_run(world):
    """alice signs in on /ui (its script lists her job), opens the job's page (plotly from this
    server draws the reward curve from the event stream): no console error, so no violation. A
    script added to the page does not run there; the same one does on a page without the policy
    (the control)."""
    app, key, job_id = world
    port, server = serve_in_thread(app)
    url = f"http://127.0.0.1:{port}"
    driver = _browser()
    inject = ("const s = document.createElement('script'); s.textContent = 'window.injected = 1';"
              "document.body.append(s); return window.injected === 1")
    try:
        driver.get(f"{url}/ui")
        driver.find_element("id", "key").send_keys(key)
        driver.find_element("css selector", "#signin button").click()
        wait_for(lambda: driver.find_elements("id", f"job-{job_id}"), "alice's job in her list")
        driver.get(f"{url}/ui/jobs/{job_id}")  # (the list redraws itself: a row found may be gone when clicked)

        def points():
            return driver.execute_script(
                "const d = document.getElementById('chart-reward').data; return d && d.length ? d[0].x.length : 0")

        wait_for(lambda: points() == 5, "five points on the reward curve")
        assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
        assert driver.execute_script(inject) is False
        assert any("Content Security Policy" in e["message"] for e in driver.get_log("browser"))
        driver.get("about:blank")  # the control: no policy, the same script runs
        assert driver.execute_script(inject) is True
    finally:
        driver.quit()
        server.should_exit = True


# -- the request head -------------------------------------------------------------------------------
def send_head(port: int, header_bytes: int) -> bytes:
    """The server's answer to a GET whose one header holds `header_bytes` bytes (b"" if it only
    hung up). Sent from a thread while this one reads, so a server that answers early is heard."""
    sock = socket.create_connection(("127.0.0.1", port))

    def write():
        try:
            sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * header_bytes + b"\r\n\r\n")
        except OSError:
            pass  # the server stopped reading: it answered, or hung up

    writer = threading.Thread(target=write)
    writer.start()
    try:
        return read_answer(sock)
    finally:
        sock.close()
        writer.join()


def read_answer(sock) -> bytes:
    data = b""
    try:
        while b"\r\n\r\n" not in data and (chunk := sock.recv(65536)):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1)) if head else 0
        while len(body) < length and (chunk := sock.recv(65536)):
            body += chunk
        return head + b"\r\n\r\n" + body
    except OSError:
        return data


def test_lockstep_serve_refuses_a_1_mb_header_with_431_and_goes_on_serving(tmp_path):
    srv = make_server(tmp_path)
    srv.start(worker=False)
    try:
        port = int(srv.url.rsplit(":", 1)[1])
        answer = send_head(port, 1 << 20)
        status, _, body = answer.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 431"), answer[:200]
        assert f"exceed {http_head.MAX_HEAD_BYTES} bytes" in json.loads(body)["error"]
        assert send_head(port, 60_000).startswith(b"HTTP/1.1 200")  # under the cap: served
        many = {f"x-h{i}": "v" * 60 for i in range(1200)}  # 80 KB in many small headers, sent in one write
        assert httpx.get(f"{srv.url}/v1/health", headers=many, timeout=30).status_code == 431
        assert httpx.get(f"{srv.url}/v1/health", timeout=30).json()["status"] == "ok"
    finally:
        srv.stop()


def test_without_the_bound_uvicorns_httptools_reads_and_serves_the_1_mb_header(tmp_path):
    """The control: the same app under uvicorn's own httptools protocol answers the attack 200."""
    app = create_app(ServiceConfig(db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", storage_url=str(tmp_path / "s")))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, http="httptools", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, "the server")
    try:
        assert send_head(server.servers[0].sockets[0].getsockname()[1], 1 << 20).startswith(b"HTTP/1.1 200")
    finally:
        server.should_exit = True
