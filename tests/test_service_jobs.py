"""Native jobs: submit / jobs / logs from the CLI, artifacts, datasets and a job's own final model
as inputs, retries, errors and logs, cancel, quotas, the wall-clock cap, job processes ending with
their worker, and a reserved job preempting a preemptible one, which resumes from its checkpoint
afterwards."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from lockstep.runtime.ledger import audit
from test_service_sdk import make_server

SMALL = ["stages.0.steps=4", "stages.0.batch_size=16", "stages.0.eval_every=2", "stages.0.target_accuracy=0.0",
         "rl.steps=3", "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_every=10", "rl.max_seconds=0",
         "env.num_heldout=8", "env.pass_k=0"]


WALL_CAP_S = 12
"""The "capped" tenant's max_wall_seconds in this module's policy."""
HOG_CAP_MB = 2048
"""The "hog" tenant's max_job_memory_mb (address space per process, under RLIMIT_AS)."""
HOG_MODULE = 'user_env_modules = ["memory_hog_env"]'
HOG_PATH = {"PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)}
"""The job processes import tests/memory_hog_env.py (an allowlisted user env) from here."""


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jobs")
    srv = make_server(tmp, env=HOG_PATH)
    srv.keys = {name: srv.key(name) for name in ("alice", "bob", "capped", "hog")}
    out = subprocess.run([sys.executable, "-m", "lockstep.cli", "tenants", "create", "solo", "--db", srv.db, "--json",
                          "--max-jobs", "1"], check=True, capture_output=True, text=True, env=srv.env).stdout
    srv.keys["solo"] = json.loads(out.strip().splitlines()[-1])["api_key"]
    srv.home_jobs = Path(srv.env["LOCKSTEP_HOME"]) / "service" / "worker" / "jobs"
    (tmp / "policy.toml").write_text(f"[tenants.capped]\nmax_wall_seconds = {WALL_CAP_S}\n"
                                     f"[tenants.hog]\nmax_job_memory_mb = {HOG_CAP_MB}\n{HOG_MODULE}\n")
    # RLIMIT_AS here, at the default cap for every other tenant: the jobs of this module show that
    # normal jobs run under it (tests/test_service_job_memory.py covers the cgroups).
    srv.start("--job-slots", "2", "--policy", str(tmp / "policy.toml"), "--job-memory", "rlimit")
    yield srv
    srv.stop()


def cli(service, tenant, *args, check=True, **env_extra):
    env = {**service.env, "LOCKSTEP_SERVER": service.url, "LOCKSTEP_API_KEY": service.keys[tenant], **env_extra}
    r = subprocess.run([sys.executable, "-m", "lockstep.cli", *args], capture_output=True, text=True, env=env,
                       timeout=600)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def api(service, tenant, method, path, **kw):
    return httpx.request(method, f"{service.url}/v1/{path}", headers={"Authorization": f"Bearer {service.keys[tenant]}"},
                         timeout=60, **kw)


def submit(service, tenant, *overrides, priority="preemptible", name="job", max_attempts=3):
    out = cli(service, tenant, "submit", *SMALL, *overrides, "--priority", priority, "--name", name,
              "--max-attempts", str(max_attempts), "--json").stdout
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


def state_events(service, tenant, job_id) -> list[str]:
    return [d["state"] for k, d in events(service, tenant, job_id) if k == "state"]


def test_a_job_runs_streams_and_serves_its_artifacts(service):
    job_id = submit(service, "alice", name="first")
    logs = cli(service, "alice", "logs", job_id[:7], "-f")  # a unique prefix; follows until the job ends
    assert "job ended: succeeded" in logs.stdout and "step 7:" in logs.stdout and "reward=" in logs.stdout
    listed = json.loads(cli(service, "alice", "jobs", "--json").stdout)
    job = next(j for j in listed if j["id"] == job_id)
    assert job["state"] == "succeeded" and job["attempts"] == 1 and job["summary"]["steps"] == 7
    assert state_events(service, "alice", job_id) == ["queued", "starting", "running", "succeeded"]
    trained = [d["step"] for k, d in events(service, "alice", job_id) if k == "metrics" and "train/loss_sum" in d]
    assert trained == list(range(1, 8))  # the metrics tail sent each record once
    table = cli(service, "alice", "jobs", COLUMNS="80").stdout  # a terminal of 80 columns
    assert job_id in table and max(len(line) for line in table.splitlines()) <= 80, table
    detail = cli(service, "alice", "job", job_id[:5]).stdout
    assert f"id: {job_id}" in detail and "state: succeeded" in detail
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


def upload(service, tenant, tmp_path, rows, name="rows.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = cli(service, tenant, "dataset", "upload", str(path), "--json").stdout
    return json.loads(out.strip().splitlines()[-1])["id"]


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_failing_job_is_retried_with_backoff_then_fails_with_a_message(service, tmp_path):
    ds = upload(service, "alice", tmp_path, [{"question": f"{i}+1", "result": i + 1} for i in range(20)])
    spec = {"env": {"name": "math", "path": ds, "num_heldout": 4}}  # rows lack the fields the suite reads
    r = api(service, "alice", "POST", "jobs", json={"spec": spec, "max_attempts": 2})
    job = wait_state(service, "alice", r.json()["id"], ("failed",), timeout=240)
    states = [d["state"] for k, d in events(service, "alice", job["id"]) if k == "state"]
    assert states == ["queued", "starting", "running", "queued", "starting", "running", "failed"]
    assert job["attempts"] == 2
    assert job["error"].startswith("attempt 2 exited with code 2: env: inputs/") and "no usable rows" in job["error"]
    assert "Traceback" not in job["error"] and str(service.home_jobs) not in job["error"], job["error"]
    out = cli(service, "alice", "logs", job["id"], "--output").stdout  # the attempt's whole output
    assert "no usable rows" in out and str(service.home_jobs) not in out
    first = api(service, "alice", "GET", f"jobs/{job['id']}/logs", params={"attempt": 1})
    assert first.status_code == 200 and "no usable rows" in first.text
    assert api(service, "bob", "GET", f"jobs/{job['id']}/logs").status_code == 404


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_job_trains_on_a_dataset_from_a_final_model_of_its_tenant(service, tmp_path):
    """Inputs are references the worker resolves: the tenant's uploaded dataset, and its own
    earlier job's final model (copied into the new job's directory, never read by a client path)."""
    base = submit(service, "alice", "rl.steps=1", name="base")
    wait_state(service, "alice", base, ("succeeded",))
    rows = [{"problem": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(4)]
    ds = upload(service, "alice", tmp_path, rows)
    job = submit(service, "alice", f'model.path="job:{base}"', "env.name=math", f'env.path="{ds}"', name="chained")
    done = wait_state(service, "alice", job, ("succeeded", "failed"))
    assert done["state"] == "succeeded", done["error"]
    inputs = service.home_jobs / job / "inputs"
    assert (inputs / "model" / "config.json").is_file() and (inputs / f"{ds}.jsonl").read_text().count("\n") == 40
    config = json.loads(api(service, "alice", "GET", f"jobs/{job}/artifacts/config.json").text)
    assert config["model"]["path"] == str(inputs / "model") and config["env"]["path"] == str(inputs / f"{ds}.jsonl")
    r = api(service, "bob", "POST", "jobs", json={"spec": {"model": {"path": f"job:{base}"}}})
    assert r.status_code == 400 and "none of your succeeded jobs" in r.json()["error"]


def job_processes(home: str, job_id: str) -> list[psutil.Process]:
    """The job's `lockstep run` and the Ray actors of the only job on that server's Ray."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or ())
            if f"jobs/{job_id}/" in cmd or (cmd.startswith("ray::") and any(
                    a in cmd for a in ("TrainerActor", "GeneratorActor", "EnvWorker"))
                    and p.environ().get("LOCKSTEP_HOME") == home):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def gone(procs, timeout: float) -> list[psutil.Process]:
    deadline = time.time() + timeout
    alive = procs
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return alive


def test_the_wall_clock_cap_stops_and_fails_a_job(service):
    job_id = submit(service, "capped", "rl.steps=400", name="endless")
    running = wait_state(service, "capped", job_id, ("running",))
    procs = job_processes(service.env["LOCKSTEP_HOME"], job_id)
    assert procs, "the job's process was not found"
    job = wait_state(service, "capped", job_id, ("failed",), timeout=WALL_CAP_S + 120)
    assert job["attempts"] == 1 and f"over this server's cap max_wall_seconds = {WALL_CAP_S}" in job["error"]
    # The cap is about time, so the product's own figures are held to it: stopped once its running
    # time reached the cap, not before (how soon after is the scheduler's tick, not asserted), and
    # stopped rather than ended: the 400 steps were not done.
    ran = float(re.search(r"stopped after (\d+) s of running time", job["error"]).group(1))
    assert WALL_CAP_S <= ran and WALL_CAP_S <= job["run_seconds"], (running, job)
    steps = [d["step"] for k, d in events(service, "capped", job_id) if k == "metrics" and "step" in d]
    assert max(steps, default=0) < 400, steps
    assert state_events(service, "capped", job_id) == ["queued", "starting", "running", "failed"]
    assert gone(procs, 10) == []


def test_a_job_over_its_memory_cap_fails_alone_with_a_message_under_rlimit(service):
    """RLIMIT_AS (no cgroup): a job allocating 8 GiB under a 2 GiB cap is refused its memory,
    fails at once (no retry: it would go over again) with the cap in its error, and the worker
    runs the next job. (The control, the same allocation under a larger cap, and the whole
    worker tree's memory are in tests/test_service_job_memory.py.)"""
    r = api(service, "hog", "POST", "jobs", json={"spec": {"env": {"name": "memory_hog_env:make_suite", "size": 8192}}})
    job = wait_state(service, "hog", r.json()["id"], ("failed", "succeeded"))
    assert job["attempts"] == 1, job
    assert job["error"] == (f"attempt 1 ran out of memory: over this server's memory cap max_job_memory_mb = "
                            f"{HOG_CAP_MB} (MiB of address space per process)"), job["error"]
    output = cli(service, "hog", "logs", job["id"], "--output").stdout
    held = [int(line.split()[-2]) for line in output.splitlines() if line.startswith("memory hog: holding")]
    assert held and max(held) < HOG_CAP_MB and "MemoryError" in output, output[-2000:]


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_job_processes_end_with_their_worker(tmp_path):
    """kill -9 of the worker: its job's `lockstep run` and that run's Ray actors are gone within seconds."""
    srv = make_server(tmp_path)
    srv.keys = {"alice": srv.key("alice")}
    serve = srv.start()
    try:
        job_id = submit(srv, "alice", "rl.steps=400", name="orphan")
        deadline = time.time() + 300
        while not [d for k, d in events(srv, "alice", job_id) if k == "metrics"]:  # the actors are up
            assert time.time() < deadline, "the job did not get going"
            time.sleep(0.5)
        procs = job_processes(srv.env["LOCKSTEP_HOME"], job_id)
        names = [" ".join(p.cmdline()) for p in procs]
        assert any("lockstep.cli run" in n for n in names) and any("TrainerActor" in n for n in names), names
        worker = next(p for p in psutil.Process(serve.pid).children() if "worker" in p.cmdline())
        os.kill(worker.pid, signal.SIGKILL)
        alive = gone(procs, 15)
        assert alive == [], [(p.pid, p.cmdline()[:3]) for p in alive]
    finally:
        srv.stop()


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
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
    assert state_events(service, "solo", first) == ["queued", "starting", "running", "cancelling", "cancelled"]
    wait_state(service, "solo", second, ("succeeded",))
    assert api(service, "solo", "POST", f"jobs/{first}/cancel").status_code == 409  # it already ended


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_reserved_job_preempts_and_the_preempted_job_resumes(service):
    long_a = submit(service, "alice", "rl.steps=100", "runtime.checkpoint_every=5", name="a", max_attempts=1)
    long_b = submit(service, "bob", "rl.steps=100", "runtime.checkpoint_every=5", name="b", max_attempts=1)
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
    assert [d["state"] for d in states] == ["queued", "starting", "running", "preempting", "queued", "starting",
                                            "running", "succeeded"]
    # A preemption is no failed attempt: the job resumes under attempt 1, its max_attempts of 1 intact.
    assert states[5] == {"state": "starting", "attempt": 1, "resumed": True} and done[victim]["attempts"] == 1
    run_dir = service.home_jobs / victim / "run"
    led = audit(run_dir / "ledger.jsonl")  # the resumed job trained every group exactly once
    assert sorted(set(led.trained_step.values())) == list(range(1, 101)) and led.pending() == []


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_jobs_page_updates_live_in_a_browser_and_stays_its_tenants(service, tmp_path):
    """/ui: alice signs in with her key, finds her running job and opens its page; the reward curve
    grows as steps arrive, the pipeline panel ends equal to the job's metrics.jsonl, the console
    stays clean; bob, signed in with his key, cannot see the job, by the list or by its URL."""
    from test_dashboard import _browser, click, wait_for

    job_id = submit(service, "alice", "rl.steps=12", "rl.prompts_per_step=2", name="watched")
    driver = _browser()
    try:
        driver.get(f"{service.url}/ui")
        driver.find_element("id", "key").send_keys(service.keys["alice"])
        driver.find_element("css selector", "#signin button").click()
        wait_for(lambda: click(driver, f"#job-{job_id} a"), "the job's link in alice's list")

        def points():
            return driver.execute_script(
                "const d = document.getElementById('chart-reward').data; return d && d.length ? d[0].x.length : 0")

        first = wait_for(lambda: points() >= 2 and points(), "two points on the reward curve", timeout=300)
        wait_for(lambda: points() > first, "the reward curve to grow as steps arrive", timeout=300)
        assert wait_state(service, "alice", job_id, ("succeeded",))["state"] == "succeeded"
        wait_for(lambda: points() == 12, "every RL step on the curve")
        records = [json.loads(x) for x in api(service, "alice", "GET", f"jobs/{job_id}/artifacts/metrics.jsonl").text.splitlines()]
        latest = {}
        for r in records:
            latest.update({k: v for k, v in r.items() if isinstance(v, (int, float))})
        cells = {c.get_attribute("data-key"): c.text for c in driver.find_elements("css selector", "#pipeline td[data-key]")}
        assert float(cells["throughput/samples_per_s"]) == pytest.approx(latest["throughput/samples_per_s"], rel=1e-3)
        for key, shown in cells.items():
            assert (float(shown) == pytest.approx(latest[key], rel=1e-3)) if key in latest else shown == "–", key
        assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
        driver.save_screenshot(str(tmp_path / "job.png"))
        # bob: his list has no such job, and its page answers as for an unknown one
        driver.execute_script("sessionStorage.setItem('lockstep-api-key', arguments[0])", service.keys["bob"])
        driver.get(f"{service.url}/ui")
        wait_for(lambda: driver.find_element("id", "signed-in").is_displayed(), "bob's list")
        assert not driver.find_elements("id", f"job-{job_id}")
        driver.get(f"{service.url}/ui/jobs/{job_id}")
        wait_for(lambda: "unknown job" in driver.find_element("id", "status").text, "the page to refuse the job")
        assert points() == 0 and driver.find_element("id", "step").text == "0"
        driver.get_log("browser")  # (the refused request is logged as a failed load: expected)
    finally:
        driver.quit()



@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_agentic_env_jobs_run_their_programs_sandboxed(service):
    """The code and python_tool envs run as jobs (model-written programs in the job's sandbox); a
    spec that asks for looser sandbox limits than the server's caps is refused up front."""
    code = submit(service, "bob", "env.name=code", "env.sandbox.wall_s=3", "env.sandbox.cpu_s=1", name="code")
    tool = submit(service, "bob", "env.name=python_tool", "env.size=40", "env.max_turns=2", "rollout.fork.turn=1",
                  "env.sandbox.wall_s=3", name="tool")
    for job_id, key in ((code, "env/tests_passed"), (tool, "env/tool_calls")):
        done = wait_state(service, "bob", job_id, ("succeeded", "failed"))
        assert done["state"] == "succeeded", done["error"]
        metrics = [r for r in map(json.loads, api(service, "bob", "GET", f"jobs/{job_id}/artifacts/metrics.jsonl")
                                  .text.splitlines()) if "rollout/reward_mean" in r]
        assert len(metrics) == 3 and all(key in r and r["env/failed_groups"] == 0 for r in metrics)
    r = api(service, "bob", "POST", "jobs", json={"spec": {"env": {"name": "code", "sandbox": {"wall_s": 3600}}}})
    assert r.status_code == 400 and "env.sandbox.wall_s = 3600.0 is over this server's cap" in r.json()["error"]
