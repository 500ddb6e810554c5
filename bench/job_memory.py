"""A job's memory cap against the whole server: `lockstep serve` runs inside a cgroup of this
script's own, whose peak covers every process of the server (the worker's per-job cgroups are
made under it). After a warm-up job (the first job leaves Ray's workers for its slots in the
server), each row is one job: how far the server's peak rose above its usage before the job, and
how the job ended (the worker's log, on stderr, has each attempt's own peak).

    .venv/bin/python bench/job_memory.py [--cap-mb 768] [--ask-mb 2048]

Rows: a job allocating --ask-mb under a --cap-mb cap (stopped at the cap), the same job under an
8 GiB cap (the control: it takes all it asks for), and a normal small RL job under the default cap.
Needs a writable cgroup memory controller (v2 delegated, or v1), as the worker's cgroup path does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import emit  # noqa: E402
from lockstep import memlimit  # noqa: E402
from test_service_jobs import HOG_MODULE, HOG_PATH, api, submit, wait_state  # noqa: E402
from test_service_sdk import make_server  # noqa: E402

MiB = 1 << 20


def measured(meter: memlimit.JobMemory, run) -> tuple[int, dict, float]:
    """(peak growth in bytes, run()'s job, seconds) with the peak reset first (per descriptor on v2)."""
    cg = meter.cgroup
    v1 = cg.kind == "cgroup1"
    with open(cg.path / ("memory.max_usage_in_bytes" if v1 else "memory.peak"), "r+") as peak:
        peak.write("0")
        peak.flush()
        base = int((cg.path / ("memory.usage_in_bytes" if v1 else "memory.current")).read_text())
        t0 = time.time()
        job = run()
        peak.seek(0)
        return int(peak.read()) - base, job, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap-mb", type=int, default=768)
    ap.add_argument("--ask-mb", type=int, default=2048)
    a = ap.parse_args()
    backend = memlimit.detect("cgroup")
    meter = memlimit.JobMemory(backend, f"bench-{uuid.uuid4().hex[:8]}", 1 << 40)
    meter.make()
    tmp = Path(tempfile.mkdtemp(prefix="lockstep-memory-"))
    srv = make_server(tmp, env={**HOG_PATH, memlimit.CGROUP_ENV: str(meter.cgroup.path)})
    srv.keys = {name: srv.key(name) for name in ("alice", "hog", "roomy")}
    (tmp / "policy.toml").write_text(f"[tenants.hog]\nmax_job_memory_mb = {a.cap_mb}\n{HOG_MODULE}\n"
                                     f"[tenants.roomy]\nmax_job_memory_mb = 8192\n{HOG_MODULE}\n")

    def hog(tenant, size):
        spec = {"env": {"name": "memory_hog_env:make_suite", "size": size}}
        job_id = api(srv, tenant, "POST", "jobs", json={"spec": spec, "max_attempts": 1}).json()["id"]
        return wait_state(srv, tenant, job_id, ("failed", "succeeded"), timeout=600)

    def normal():
        return wait_state(srv, "alice", submit(srv, "alice", "rl.steps=3"), ("failed", "succeeded"), timeout=600)

    rows = []
    srv.start("--job-slots", "2", "--policy", str(tmp / "policy.toml"), wrap=tuple(meter.wrap([])))
    try:
        hog("hog", 64)  # the warm-up
        for what, cap, run in ((f"asks {a.ask_mb} MiB, cap {a.cap_mb}", a.cap_mb, lambda: hog("hog", a.ask_mb)),
                               (f"asks {a.ask_mb} MiB, cap 8192 (control)", 8192, lambda: hog("roomy", a.ask_mb)),
                               ("normal RL job (7 steps)", 16384, normal)):
            grew, job, wall = measured(meter, run)
            rows.append({"job": what, "cap_mib": cap, "server_peak_growth_mib": round(grew / MiB),
                         "state": job["state"], "error": (job["error"] or "")[-80:], "wall_s": round(wall, 1)})
    finally:
        srv.stop()
    meter.kill()
    emit("job_memory", rows, {"backend": backend.kind})


if __name__ == "__main__":
    main()
