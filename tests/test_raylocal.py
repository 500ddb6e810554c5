"""`lockstep run`'s Ray listens on loopback only, and a killed driver leaves no process behind.
(The service worker's side is in test_service_faults.py.)"""

import os
import subprocess
import sys
import time

import psutil
import pytest

from lockstep import raylocal
from service_harness import alive

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
LONG = ["stages.0.steps=100000", "stages.0.batch_size=8", "stages.0.eval_every=100000", "env.num_heldout=8",
        "env.pass_k=0", "rl.steps=1"]


def names(procs) -> str:
    out = []
    for p in alive(procs):
        try:
            out.append(" ".join(p.cmdline())[:100])
        except psutil.NoSuchProcess:
            pass
    return "\n".join(out)


def bound_sockets(pids: set[int]) -> list:
    return [(c.pid, c.laddr) for c in psutil.net_connections("inet")
            if c.pid in pids and (c.status == psutil.CONN_LISTEN or c.type == 2) and c.laddr]


def servers_listening(procs, bound) -> bool:
    """Whether the gcs_server and the raylet each have a bound socket."""
    listening = {pid for pid, _ in bound}
    servers = []
    for p in alive(procs):
        try:
            if p.name() in ("gcs_server", "raylet"):
                servers.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return len(servers) >= 2 and all(pid in listening for pid in servers)


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_run_binds_loopback_only_and_nothing_outlives_a_killed_driver(tmp_path, builtin_dir):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop(raylocal.LOOPBACK_SWITCH, None)  # what a user's shell has
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "run", *LONG, f"model.path='{builtin_dir}'",
                             "--run-dir", str(tmp_path / "run")], env=env, stdout=open(tmp_path / "log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        parts = ("gcs_server", "raylet", "TrainerActor", "GeneratorActor", "EnvWorker", "Agent")
        # Up: every part running, and Ray's two servers listening (their sockets come after their processes).
        while not (all(part in names(procs := psutil.Process(proc.pid).children(recursive=True)) for part in parts)
                   and servers_listening(procs, bound := bound_sockets({p.pid for p in procs} | {proc.pid}))):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.5)
        assert bound and all(addr.ip in LOOPBACK for _, addr in bound), bound
        proc.kill()  # the driver alone: nothing else gets a signal from us
        proc.wait()
        psutil.wait_procs(procs, timeout=10)
        assert not alive(procs), names(procs)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
