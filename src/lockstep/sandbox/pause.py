"""Stopping a sandbox's processes between calls where no cgroup v2 freezer can: SIGSTOP to each of
its processes, and SIGCONT at the next call. A stopped process still dies of SIGKILL, so a sandbox
stopped when its owner is killed dies with it (a cgroup v1 freezer would keep it frozen for good).

Its processes are listed by its cgroup when it has one (cgroup.procs), else through the host's
/proc (every process in its PID namespace: none can hide, and none of it is trusted to list
them). A process not yet stopped may fork or send SIGCONT meanwhile, so the list is taken again
until every thread of every process on it is seen stopped and it did not grow.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

STOP_S = 5.0
"""How long stopping may take before the caller gives up (and kills the sandbox)."""

Members = Callable[[], list[int]]


def namespace_pids(init: int) -> list[int]:
    """Host pids of the processes in the PID namespace of `init` (its first process)."""
    try:
        ns = os.readlink(f"/proc/{init}/ns/pid")
    except OSError:
        return []
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/pid") == ns:
                    out.append(int(name))
            except OSError:
                pass
    return out


def namespace_members(init: int) -> Members:
    """The namespace's processes, the host's /proc scanned again only when the sandbox's own
    procfs (the kernel's count: cheap, unforgeable) lists more than the last scan found."""
    last: list[int] = []

    def members() -> list[int]:
        nonlocal last
        alive = [pid for pid in last if os.path.exists(f"/proc/{pid}")]
        try:
            inside = sum(name.isdigit() for name in os.listdir(f"/proc/{init}/root/proc"))
        except OSError:
            inside = -1
        last = alive if inside == len(alive) else namespace_pids(init)
        return last

    return members


def _stopped(pid: int) -> bool:
    """Every thread of `pid` stopped (or gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"T", b"t", b"Z", b"X"):
            return False
    return True


def stop(members: Members) -> bool:
    """SIGSTOP every member; True once all are seen stopped and no new one appeared."""
    deadline = time.monotonic() + STOP_S
    while time.monotonic() < deadline:
        pids = members()
        running = [pid for pid in pids if not _stopped(pid)]
        if not running and set(members()) <= set(pids):
            return True
        for pid in running:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        time.sleep(0.0005)  # signals are delivered asynchronously
    return False


def resume(members: Members) -> None:
    for pid in members():
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
