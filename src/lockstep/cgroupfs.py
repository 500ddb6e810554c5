"""What /proc says about this process's cgroups: the cgroup mounts and this process's own paths.

Shared by the sandbox's cgroups (sandbox/cgroup.py) and the job memory limit (memlimit.py); torch-
and Ray-free. Written by hand for the reason those modules give (no maintained library covers v1
and v2), and small: two /proc files read.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple


class Mount(NamedTuple):
    """One cgroup mount (a line of /proc/self/mountinfo)."""

    point: str
    """Where it is mounted."""
    root: str
    """The hierarchy's directory mounted there ("/" unless a namespace or bind mount narrows it)."""
    fstype: str
    """"cgroup2", or "cgroup" (v1)."""
    options: frozenset[str]
    """Super options: on v1, the controllers of the hierarchy."""


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field


def mounts() -> list[Mount]:
    """Every cgroup mount this process sees."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append(Mount(_unescape(fields[4]), _unescape(fields[3]), tail[0], frozenset(tail[2].split(","))))
    return out


def own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" the v2 one."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def procs(directory: Path) -> list[int]:
    """The processes in a cgroup directory ([] once it is gone)."""
    try:
        return [int(p) for p in (directory / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def oom_kills(memory_dir: Path, v2: bool) -> int:
    """Processes the kernel OOM-killed in a cgroup so far (memory.events on v2, memory.oom_control
    on v1's memory hierarchy); 0 once it is gone."""
    try:
        for line in (memory_dir / ("memory.events" if v2 else "memory.oom_control")).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
