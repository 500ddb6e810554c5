"""Native jobs: submit / jobs / logs from the CLI, artifacts, retries, cancel, quotas, and a
reserved job preempting a preemptible one, which resumes from its checkpoint afterwards."""

import io
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import pytest

from lockstep.runtime.ledger import audit
from test_service_sdk import make_server

SMALL = ["stages.0.steps=4", "stages.0.batch_size=16", "stages.0.eval_every=2", "stages.0.target_accuracy=0.0",
         "rl.steps=3", "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_every=10", "rl.max_seconds=0",
         "env.num_heldout=8", "env.pass_k=0"]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    srv = make_server(tmp_path_factory.mktemp("jobs"))
    srv.keys = {"alice": srv.key("alice"), "bob": srv.key("bob")}
    out = subprocess.run([sys.executable, "-m", "lockstep.cli", "tenants", "create", "solo", "--db", srv.db, "--json",
                          "--max-jobs", "1"], check=True, capture_output=True, text=True, env=srv.env).stdout
    srv.keys["solo"] = json.loads(out.strip().splitlines()[-1])["api_key"]
    srv.home_jobs = Path(srv.env["LOCKSTEP_HOME"]) / "service" / "worker" / "jobs"
    srv.start("--job-slots", "2")
    yield srv
    srv.stop()


def cli(service, tenant, *args, check=True):
    env = {**service.env, "LOCKSTEP_SERVER": service.url, "LOCKSTEP_API_KEY": service.keys[tenant]}
    r = subprocess.run([sys.executable, "-m", "lockstep.cli", *args], capture_output=True, text=True, env=env,
                       timeout=600)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def api(service, tenant, method, path, **kw):
    return httpx.request(method, f"{service.url}/v1/{path}", headers={"Authorization": f"Bearer {service.keys[tenant]}"},
                         timeout=60, **kw)


def submit(service, tenant, *overrides, priority="preemptible", name="job"):
    out = cli(service, tenant, "submit", *SMALL, *overrides, "--priority", priority, "--name", name, "--json").stdout
    return json.loads(out.strip().splitlines()[-1])["id"]


def wait_state(service, tenant, job_id, states, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = api(service, tenant, "GET", f"jobs/{job_id}").json()
        if job["state"] in states:
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} still {job['state']} after {timeout}s: {job.get('error')}")


def events(service, tenant, job_id):
    r = api(service, tenant, "GET", f"jobs/{job_id}/events", params={"follow": "false"})
    out, kind = [], None
    for line in r.text.splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: ") and kind != "end":
            out.append((kind, json.loads(line[6:])))
    return out


def test_a_job_runs_streams_and_serves_its_artifacts(service):
    job_id = submit(service, "alice", name="first")
    logs = cli(service, "alice", "logs", job_id, "-f")  # follows until the job ends
    assert "job ended: succeeded" in logs.stdout and "step 7:" in logs.stdout and "reward=" in logs.stdout
    listed = json.loads(cli(service, "alice", "jobs", "--json").stdout)
    job = next(j for j in listed if j["id"] == job_id)
    assert job["state"] == "succeeded" and job["attempts"] == 1 and job["summary"]["steps"] == 7
    assert "<img" in api(service, "alice", "GET", f"jobs/{job_id}/artifacts/report.html").text
    tar = tarfile.open(fileobj=io.BytesIO(api(service, "alice", "GET", f"jobs/{job_id}/artifacts/final_model.tar").content))
    assert {"final_model/config.json", "final_model/model.safetensors"} <= set(tar.getnames())
    assert api(service, "bob", "GET", f"jobs/{job_id}").status_code == 404  # another tenant's job
    usage = api(service, "alice", "GET", "usage").json()
    assert usage["compute_seconds"] > 0 and usage["tokens_trained"] > 0 and usage["tokens_sampled"] > 0


def test_bad_specs_are_refused_before_anything_is_stored(service):
    r = cli(service, "alice", "submit", "rl.max_stalness=2", check=False)
    assert r.returncode != 0 and "did you mean 'max_staleness'" in r.stderr
    bad = api(service, "alice", "POST", "jobs", json={"spec": {"stages": [{"kind": "rl", "loss": "stable_reinforce"}]}})
    assert bad.status_code == 400 and "stable_reinforce" in bad.json()["error"]
    before = len(api(service, "alice", "GET", "jobs").json()["jobs"])
    assert api(service, "alice", "POST", "jobs", json={"spec": {"modle": {}}}).status_code == 400
    assert len(api(service, "alice", "GET", "jobs").json()["jobs"]) == before


def test_a_failing_job_is_retried_with_backoff_then_fails(service):
    r = api(service, "alice", "POST", "jobs", json={"spec": {"env": {"name": "no_such_module:make"}}, "max_attempts": 2})
    job = wait_state(service, "alice", r.json()["id"], ("failed",), timeout=240)
    assert job["attempts"] == 2 and "cannot import module 'no_such_module'" in job["error"]
    states = [d["state"] for k, d in events(service, "alice", job["id"]) if k == "state"]
    assert states == ["queued", "running", "queued", "running", "failed"]


def test_cancel_and_the_concurrent_jobs_quota(service):
    first = submit(service, "solo", "rl.steps=400", name="long")
    wait_state(service, "solo", first, ("running",))
    second = submit(service, "solo", name="waits")
    # A slot is free, but the tenant may run one job at a time: a later job of another tenant
    # starts in that slot (the scheduler, going oldest first, passed `second` by) while it waits.
    later = submit(service, "alice", name="later")
    wait_state(service, "alice", later, ("running", "succeeded"))
    assert api(service, "solo", "GET", f"jobs/{second}").json()["state"] == "queued"
    assert api(service, "solo", "POST", f"jobs/{first}/cancel").json()["state"] == "cancelling"
    assert wait_state(service, "solo", first, ("cancelled",))["state"] == "cancelled"
    wait_state(service, "solo", second, ("succeeded",))
    assert api(service, "solo", "POST", f"jobs/{first}/cancel").status_code == 409  # it already ended


def test_a_reserved_job_preempts_and_the_preempted_job_resumes(service):
    long_a = submit(service, "alice", "rl.steps=100", "runtime.checkpoint_every=5", name="a")
    long_b = submit(service, "bob", "rl.steps=100", "runtime.checkpoint_every=5", name="b")
    for tenant, jid in (("alice", long_a), ("bob", long_b)):
        deadline = time.time() + 300
        while max([d.get("step", 0) for k, d in events(service, tenant, jid) if k == "metrics"] or [0]) < 8:
            assert time.time() < deadline, "the long jobs did not get going"
            time.sleep(0.3)  # past a checkpoint (SFT 4 steps + RL 4)
    urgent = submit(service, "alice", priority="reserved", name="urgent")
    assert wait_state(service, "alice", urgent, ("succeeded",))["attempts"] == 1
    done = {jid: wait_state(service, t, jid, ("succeeded",), timeout=600) for t, jid in (("alice", long_a), ("bob", long_b))}
    preempted = [jid for jid, job in done.items() if job["preemptions"] == 1]
    assert len(preempted) == 1, [(j["id"], j["preemptions"], events(service, t, j["id"])[:1] and [d for k, d in events(service, t, j["id"]) if k == "state"]) for t, j in zip(("alice", "bob"), done.values())]  # exactly one slot was taken back
    victim = preempted[0]
    tenant = "alice" if victim == long_a else "bob"
    states = [d for k, d in events(service, tenant, victim) if k == "state"]
    assert [d["state"] for d in states] == ["queued", "running", "preempting", "queued", "running", "succeeded"]
    assert states[4]["resumed"] is True and done[victim]["attempts"] == 2
    run_dir = service.home_jobs / victim / "run"
    led = audit(run_dir / "ledger.jsonl")  # the resumed job trained every group exactly once
    assert sorted(set(led.trained_step.values())) == list(range(1, 101)) and led.pending() == []
