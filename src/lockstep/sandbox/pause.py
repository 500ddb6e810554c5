"""Stopping a sandbox's processes between calls where it has no cgroup freezer: SIGSTOP to every
process of its PID namespace, found through the host's /proc (no process can hide from it, and a
namespace's processes cannot be listed from inside it without trusting them).

A process not yet stopped may fork or send SIGCONT meanwhile, so the namespace is walked again
until every thread of every process in it is seen stopped; continue_namespace() undoes it.
"""

from __future__ import annotations

import os
import signal
import time

STOP_S = 5.0
"""How long stopping may take before the caller gives up (and kills the sandbox)."""


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


def _count_inside(init: int) -> int:
    """How many processes the sandbox's own procfs lists (the kernel's count: cheap, unforgeable)."""
    try:
        return sum(name.isdigit() for name in os.listdir(f"/proc/{init}/root/proc"))
    except OSError:
        return -1


def stop_namespace(init: int) -> bool:
    """SIGSTOP every process of the namespace; True once all are seen stopped. The host's /proc is
    scanned again only when the namespace holds processes the last scan did not find."""
    deadline, pids = time.monotonic() + STOP_S, namespace_pids(init)
    while time.monotonic() < deadline:
        pids = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
        if _count_inside(init) != len(pids):
            pids = namespace_pids(init)
        running = [pid for pid in pids if not _stopped(pid)]
        if not running and _count_inside(init) == len(pids):
            return True
        for pid in running:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        time.sleep(0.0005)  # signals are delivered asynchronously
    return False


def continue_namespace(init: int) -> None:
    for pid in namespace_pids(init):
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
