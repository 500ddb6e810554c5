"""A job cannot exhaust the host's memory: under a cgroup of its own (the worker's default where
the host has a writable memory controller), a job allocating gigabytes past its tenant's
max_job_memory_mb is stopped and fails alone with a message naming the cap, while the whole
`lockstep serve` tree, measured by a cgroup of the test's own around it, stays under a stated
bound; the same job under a large cap (the control) takes all it asks for, and another tenant's
job and the worker go on. (RLIMIT_AS, the fallback, is tested in tests/test_service_jobs.py.)"""

import uuid

import psutil
import pytest

from lockstep import memlimit
from test_service_jobs import HOG_MODULE, HOG_PATH, api, submit, wait_state
from test_service_sdk import make_server

MiB = 1 << 20
CAP_MB = 768
"""The "hog" tenant's max_job_memory_mb."""
ASK_MB = 2048
"""What the hog job allocates (the control, under an 8 GiB cap, gets all of it)."""
MARGIN_MB = 512
"""What else the server may allocate meanwhile (its API and worker are idle)."""
BOUND = (CAP_MB + MARGIN_MB) * MiB
"""The stated bound: growth of the whole server tree's peak memory while a hog job runs."""


@pytest.fixture(scope="module")
def metered(tmp_path_factory):
    """`lockstep serve` inside a cgroup of the test's own, whose peak covers every process of the
    server (the worker's jobs' cgroups are made under it)."""
    backend = memlimit.detect("auto")
    if not backend.cgroup:
        pytest.skip(f"no writable cgroup memory controller on this host: {backend.why}")
    meter = memlimit.JobMemory(backend, f"test-serve-{uuid.uuid4().hex[:8]}", 1 << 40)
    meter.make()
    tmp = tmp_path_factory.mktemp("memory")
    srv = make_server(tmp, env={**HOG_PATH, memlimit.CGROUP_ENV: str(meter.cgroup.path)})
    srv.keys = {name: srv.key(name) for name in ("alice", "hog", "roomy")}
    (tmp / "policy.toml").write_text(f"[tenants.hog]\nmax_job_memory_mb = {CAP_MB}\n{HOG_MODULE}\n"
                                     f"[tenants.roomy]\nmax_job_memory_mb = 8192\n{HOG_MODULE}\n")
    srv.serve = srv.start("--job-slots", "2", "--policy", str(tmp / "policy.toml"), wrap=tuple(meter.wrap([])))
    srv.meter = meter
    # A first job leaves ~600 MiB more in the server for good (Ray's workers for its slots): start
    # from there, so that what the measurements see is the jobs'.
    assert hog(srv, "hog", 64)["error"].endswith("allocated all 64 MiB")
    yield srv
    procs = [psutil.Process(pid) for pid in meter.cgroup.pids()]
    srv.stop()
    meter.kill()
    psutil.wait_procs([p for p in procs if p.is_running()], timeout=60)
    assert meter.remove()


def hog(srv, tenant: str, size_mb: int = ASK_MB) -> dict:
    """A job of memory_hog_env allocating `size_mb`, run to its end (one attempt: the hog refuses
    to run once it holds its memory, which is no reason to try again)."""
    spec = {"env": {"name": "memory_hog_env:make_suite", "size": size_mb}}
    r = api(srv, tenant, "POST", "jobs", json={"spec": spec, "max_attempts": 1})
    assert r.status_code == 200, r.text
    return wait_state(srv, tenant, r.json()["id"], ("failed", "succeeded"))


def growth(srv, run) -> tuple[int, object]:
    """How far the server tree's peak memory rose above its usage while `run()` ran (the peak is
    reset through the file descriptor it is then read from: v2 resets are per descriptor)."""
    cg = srv.meter.cgroup
    v1 = cg.kind == "cgroup1"
    with open(cg.path / ("memory.max_usage_in_bytes" if v1 else "memory.peak"), "r+") as peak:
        peak.write("0")
        peak.flush()
        base = int((cg.path / ("memory.usage_in_bytes" if v1 else "memory.current")).read_text())
        result = run()
        peak.seek(0)
        return int(peak.read()) - base, result


def worker_pid(srv) -> int:
    return next(p.pid for p in psutil.Process(srv.serve.pid).children(recursive=True) if "worker" in p.cmdline())


def test_a_job_over_its_memory_cap_is_stopped_and_the_server_stays_under_the_bound(metered):
    worker = worker_pid(metered)
    grew, job = growth(metered, lambda: hog(metered, "hog"))
    assert job["state"] == "failed" and job["attempts"] == 1, job  # not retried: it would go over again
    assert f"over this server's memory cap max_job_memory_mb = {CAP_MB} (MiB, all of the job's processes " \
           f"together)" in job["error"], job["error"]
    assert grew < BOUND, f"the server grew by {grew / MiB:.0f} MiB (bound {BOUND / MiB:.0f})"
    # The control: the same job with room takes what it asks for, past the bound.
    grew, job = growth(metered, lambda: hog(metered, "roomy"))
    assert job["error"].endswith(f"memory hog: allocated all {ASK_MB} MiB"), job["error"]
    assert grew > BOUND, f"the control grew by only {grew / MiB:.0f} MiB"
    assert worker_pid(metered) == worker


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_another_tenants_job_runs_on_while_a_job_is_stopped_for_memory(metered):
    normal = submit(metered, "alice", "rl.steps=3", name="normal")
    wait_state(metered, "alice", normal, ("running",))
    assert "max_job_memory_mb" in hog(metered, "hog")["error"]
    assert wait_state(metered, "alice", normal, ("succeeded", "failed"))["state"] == "succeeded"
