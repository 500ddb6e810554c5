"""Starting Ray on one machine safely: loopback only, and nothing outlives the process that started it.

Used by `lockstep run` (runtime/run.py's start_ray), the service worker and `lockstep serve`.

**Loopback.** By default Ray's GCS, raylet, agents and every worker listen on all interfaces. Ray
resolves "127.0.0.1" given as the node address back to the machine's routable IP, except when
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` is off, the switch Ray itself uses to keep a single-machine
instance on loopback. We turn it off for a cluster we start (and for anything joining a loopback
address, such as a job joining its worker's cluster); joining a real cluster is an explicit address.

**Fate sharing.** Ray's GCS and raylet die with the driver that started them (PR_SET_PDEATHSIG),
but not what the raylet starts: killing a driver left Ray's agents running, and its actors have
process groups of their own, so no signal to a process group reaches them. No library ties an
arbitrary process tree to one process on Linux without privileges (cgroups), so `guard()` does it by
hand: it tags the environment with a token that every process started afterwards inherits (Ray's
workers inherit the raylet's environment), and starts a small guardian process, in a session of its
own, that waits for this process to die and then SIGKILLs every process carrying the token, however
it was re-parented. It runs the same sweep after a clean exit, so a clean stop leaves nothing either.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import subprocess
import sys
import time
import uuid

MARK = "LOCKSTEP_TREE"
"""Environment variable holding the tokens of the guarded trees a process belongs to (':'-joined)."""
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
POLL_S = 0.2
"""How often the guardian looks for its process: what a process may outlive it by, at most."""
LOOK_S = 1.0
"""How often the guardian records its process's descendants."""

_guarded: tuple[int, str] | None = None


def guard() -> str:
    """Make every process this one starts from now on (and all their descendants) die with it.
    Idempotent per process; returns the token."""
    global _guarded
    if _guarded is not None and _guarded[0] == os.getpid():
        return _guarded[1]
    import psutil

    token = uuid.uuid4().hex[:16]
    os.environ[MARK] = ":".join(t for t in (os.environ.get(MARK, ""), token) if t)
    me = psutil.Process()
    subprocess.Popen([sys.executable, "-m", "lockstep.raylocal", str(me.pid), repr(me.create_time()), token],
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)
    _guarded = (os.getpid(), token)
    return token


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]") if address else ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cluster_mode(on: bool) -> None:
    """Ray's multi-node switch: off keeps a local instance on loopback; on again when joining a
    cluster by its routable address (after an earlier local instance of this process), or Ray
    would call this node 127.0.0.1 and find no raylet."""
    os.environ[LOOPBACK_SWITCH] = "1" if on else "0"  # for every process started from here (raylet, workers, jobs)
    if "ray" in sys.modules:  # Ray reads the switch once, at import; this process may have imported it already
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = on


def init(address: str = "", *, runtime_env: dict | None = None, log_to_driver: bool = False, **local) -> None:
    """Join the Ray cluster at `address`, or start a loopback-only one guarded by this process
    (`local` are ray.init's arguments for a new cluster: num_cpus, resources, ...)."""
    _cluster_mode(bool(address) and not is_loopback(address))
    import ray

    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=log_to_driver)
        return
    guard()
    # "local": a new instance even where `ray start` left a cluster (ray.init() without an address
    # would join the one named in /tmp/ray/ray_current_cluster, live or not).
    ray.init(address="local", include_dashboard=False, configure_logging=False, runtime_env=runtime_env,
             log_to_driver=log_to_driver, **local)


# -- the guardian --------------------------------------------------------------------------------
def tagged(token: str) -> list:
    """Live processes (of this user) whose environment carries `token`."""
    import psutil

    out = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if token in p.environ().get(MARK, "").split(":") and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return out


def sweep(token: str, known=(), rounds: int = 20) -> int:
    """SIGKILL every process carrying `token` and every one of `known` still running, again until
    none is left (one may have started another meanwhile); returns how many were killed."""
    import psutil

    killed = 0
    for _ in range(rounds):
        procs = tagged(token) + [p for p in known if _running(p)]
        known = ()
        if not procs:
            break
        for p in procs:
            try:
                p.kill()  # psutil refuses a pid that was reused since it was seen
                killed += 1
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=1)
    return killed


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _watch(pid: int, created: float, token: str) -> None:
    """Until the process dies, also remember its descendants: some of Ray's (its agents) rewrite
    their process title over their environment, so the token alone does not find them."""
    import psutil

    known: dict = {}
    try:
        parent = psutil.Process(pid)
        alive = abs(parent.create_time() - created) < 1e-3
        next_look = 0.0
        while alive:
            if time.monotonic() >= next_look:
                known.update((p.pid, p) for p in parent.children(recursive=True) if p.pid != os.getpid())
                next_look = time.monotonic() + LOOK_S
            time.sleep(POLL_S)
            alive = _running(parent)
    except psutil.NoSuchProcess:
        pass
    sweep(token, list(known.values()))


if __name__ == "__main__":
    args = argparse.ArgumentParser(description="kill a process's tagged tree when it dies")
    args.add_argument("pid", type=int)
    args.add_argument("created", type=float)
    args.add_argument("token")
    a = args.parse_args()
    _watch(a.pid, a.created, a.token)
