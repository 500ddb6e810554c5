"""A memory limit for a job's processes: a cgroup of its own where the host has one we may write,
an address-space rlimit per process otherwise.

The service's scheduler starts each job attempt under one (`JobMemory`); the job's processes join
it themselves before any of their own code runs: `lockstep run` through this module's wrapper
(`python -m lockstep.memlimit -- CMD...`, which joins, then execs CMD), its Ray actors through
Ray's `worker_process_setup_hook` (`enter_from_env`; they are children of the worker's raylet, not
of the job's process, so inheriting is not enough). Both read the same two variables.

- **cgroup v2**: `<the worker's cgroup>/lockstep-jobs/<name>` with `memory.max` (and
  `memory.swap.max` 0, `memory.oom.group` 1: an OOM kills the whole job); the kernel's OOM kills
  are counted in `memory.events`. Needs the memory controller delegated to the worker's cgroup
  (`+memory` in its `cgroup.subtree_control`; the worker tries to enable it).
- **cgroup v1** (the memory hierarchy, still found on older hosts and some VMs): the same place
  under the memory hierarchy, `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes`),
  OOM kills in `memory.oom_control`.
- **RLIMIT_AS**: each process's address space is capped (a job's total is not); an allocation past
  it fails (MemoryError in Python). Ray and torch map several GB they never touch (a tiny job's
  processes peak at 9.2 GB of address space for 0.6 GB resident), so the cap is far looser than
  its number suggests, and CUDA maps more address space than any cap allows: CUDA jobs run
  without one there (the worker says so at start).

Written by hand: the cgroup libraries on PyPI each cover v1 or v2 only and are unmaintained, and
what is needed here is a handful of files of each.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from lockstep.cgroupfs import mounts, oom_kills, own_paths, procs

log = logging.getLogger("lockstep.memlimit")

CGROUP_ENV = "LOCKSTEP_JOB_CGROUP"
"""The cgroup directory a job's processes join (on the node where it exists)."""
RLIMIT_ENV = "LOCKSTEP_JOB_RLIMIT_AS"
"""Bytes of address space per process, where no cgroup holds the job (or on a node without it)."""
JOBS_DIR = "lockstep-jobs"
MODES = ("auto", "cgroup", "rlimit")
MiB = 1024 * 1024


class MemoryLimitError(RuntimeError):
    """The memory limit the operator asked for cannot be set up here; the message says why."""


@dataclass(frozen=True)
class Backend:
    kind: str
    """"cgroup2", "cgroup1" or "rlimit"."""
    root: Path | None
    """Where the jobs' cgroups are made (cgroup kinds)."""
    why: str
    """Why this kind: what the start-up log says."""

    @property
    def cgroup(self) -> bool:
        return self.kind != "rlimit"


# -- finding the worker's cgroup -----------------------------------------------------------------
def _own(kind: str) -> Path | None:
    """This process's cgroup directory in the v2 hierarchy ("cgroup2") or v1's memory one, or None."""
    paths = own_paths()
    path = paths.get("") if kind == "cgroup2" else paths.get("memory")
    if path is None:
        return None
    for m in mounts():
        if (m.fstype == "cgroup2") != (kind == "cgroup2") or (kind == "cgroup1" and "memory" not in m.options):
            continue
        rel = os.path.relpath(path, m.root)
        if not rel.startswith(".."):
            return (Path(m.point) / rel).resolve()
    return None


def _enable_memory(parent: Path) -> None:
    """v2: let `parent`'s children have memory limits (no-op when they already may)."""
    if "memory" in (parent / "cgroup.subtree_control").read_text().split():
        return
    if "memory" not in (parent / "cgroup.controllers").read_text().split():
        raise OSError(errno.ENOTSUP, f"no memory controller in {parent} (cgroup.controllers)")
    (parent / "cgroup.subtree_control").write_text("+memory")


def _probe(kind: str) -> Path:
    """The directory jobs' cgroups go in, made and checked by making a limited child; OSError if not."""
    own = _own(kind)
    if own is None:
        raise OSError(errno.ENOENT, f"this process has no {kind} memory cgroup")
    root = own / JOBS_DIR
    if kind == "cgroup2":
        _enable_memory(own)  # EBUSY when the worker's own cgroup holds processes and cannot delegate
    root.mkdir(exist_ok=True)
    if kind == "cgroup2":
        _enable_memory(root)
    probe = _Cgroup(kind, root / f"w{os.getpid()}-probe")
    probe.make(64 * MiB)
    probe.remove()
    for stale in root.iterdir():  # a dead worker's (its processes died with it); never a live one's
        if stale.is_dir() and not _alive(stale.name):
            _Cgroup(kind, stale).remove(kill=False)
    return root


def _alive(name: str) -> bool:
    """Whether the worker that made cgroup `name` ("w<pid>-...", see JobMemory) still runs."""
    head = name.split("-", 1)[0]
    if not (head.startswith("w") and head[1:].isdigit()):
        return True  # not ours to judge
    try:
        os.kill(int(head[1:]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def detect(mode: str = "auto") -> Backend:
    """The memory-limit backend for `mode`: "auto" (a cgroup where possible, else RLIMIT_AS),
    "cgroup" (MemoryLimitError when none is usable: the reason and the fix) or "rlimit"."""
    if mode not in MODES:
        raise MemoryLimitError(f"job memory mode {mode!r}: expected one of {MODES}")
    if mode == "rlimit":
        return Backend("rlimit", None, "chosen by the operator (--job-memory rlimit)")
    reasons = []
    for kind in ("cgroup2", "cgroup1"):
        try:
            return Backend(kind, _probe(kind), f"per-job {kind} memory limits under {_own(kind) / JOBS_DIR}")
        except OSError as e:
            reasons.append(f"{kind}: {e.strerror or e}{f' ({e.filename})' if e.filename else ''}")
    why = "; ".join(reasons)
    if mode == "cgroup":
        raise MemoryLimitError(f"--job-memory cgroup: no writable cgroup memory controller for this worker ({why}); "
                               "run it in a cgroup with the memory controller delegated (e.g. a systemd unit with "
                               "Delegate=yes), or use --job-memory auto / rlimit")
    return Backend("rlimit", None, f"no usable cgroup ({why}): RLIMIT_AS per process instead")


# -- one cgroup ----------------------------------------------------------------------------------
class _Cgroup:
    def __init__(self, kind: str, path: Path):
        self.kind, self.path = kind, Path(path)

    def make(self, limit: int) -> None:
        self.path.mkdir()
        try:
            if self.kind == "cgroup2":
                (self.path / "memory.max").write_text(str(limit))
                _write_if_present(self.path / "memory.swap.max", "0")
                _write_if_present(self.path / "memory.oom.group", "1")
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
                _write_if_present(self.path / "memory.memsw.limit_in_bytes", str(limit))
        except BaseException:
            self.path.rmdir()
            raise

    def pids(self) -> list[int]:
        return procs(self.path)

    def oom_kills(self) -> int:
        return oom_kills(self.path, self.kind == "cgroup2")

    def peak(self) -> int | None:
        """Bytes at its highest so far (memory.peak needs Linux 5.19 on v2)."""
        name = "memory.peak" if self.kind == "cgroup2" else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL every process in it, again until none is left (one may fork meanwhile)."""
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def remove(self, *, kill: bool = True) -> bool:
        """Kill what is left in it (unless not `kill`) and delete it, its own child cgroups first;
        False if it is still busy (a killed process not yet reaped by its parent): try again later."""
        if not self.path.exists():
            return True
        children = [_Cgroup(self.kind, child) for child in self.path.iterdir() if child.is_dir()]
        if not all([child.remove(kill=kill) for child in children]):
            return False
        if kill:
            self.kill()
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            return False
        return True


def _write_if_present(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except (FileNotFoundError, PermissionError):
        pass  # no swap accounting on this host (or oom.group before Linux 4.19): nothing to bound


# -- a job's limit -------------------------------------------------------------------------------
class JobMemory:
    """One job attempt's memory limit, made before its process starts and removed after it ends."""

    def __init__(self, backend: Backend, name: str, limit_bytes: int, *, cuda: bool = False):
        self.backend, self.limit, self.cuda = backend, int(limit_bytes), cuda
        # Named after this process: another worker in the same cgroup clears only a dead one's.
        path = backend.root / f"w{os.getpid()}-{name}" if backend.cgroup else None
        self.cgroup = _Cgroup(backend.kind, path) if path is not None else None

    def make(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()  # an earlier try's, left busy
            self.cgroup.make(self.limit)

    def env(self) -> dict[str, str]:
        """What a job process needs to put itself (and its Ray workers) under the limit."""
        out = {}
        if self.cgroup is not None:
            out[CGROUP_ENV] = str(self.cgroup.path)
        if not self.cuda:  # (on a node without the cgroup, RLIMIT_AS: see the module docstring)
            out[RLIMIT_ENV] = str(self.limit)
        return out

    def wrap(self, cmd: list[str]) -> list[str]:
        return [sys.executable, "-m", "lockstep.memlimit", "--", *cmd]

    def oom_kills(self) -> int:
        return self.cgroup.oom_kills() if self.cgroup is not None else 0

    def peak(self) -> int | None:
        return self.cgroup.peak() if self.cgroup is not None else None

    def kill(self) -> None:
        if self.cgroup is not None:
            self.cgroup.kill()

    def remove(self) -> bool:
        return self.cgroup.remove() if self.cgroup is not None else True

    def describe(self, cap_name: str) -> str:
        """What ended a job that went over it, for the tenant."""
        mib = self.limit // MiB
        if self.cgroup is not None:
            return f"over this server's memory cap {cap_name} = {mib} (MiB, all of the job's processes together)"
        return f"over this server's memory cap {cap_name} = {mib} (MiB of address space per process)"


OUT_OF_MEMORY = ("MemoryError", "Cannot allocate memory", "can't allocate memory", "std::bad_alloc")
"""What an allocation refused under RLIMIT_AS looks like in a process's output."""


def ran_out(output: str) -> bool:
    return any(marker in output for marker in OUT_OF_MEMORY)


# -- inside a job's processes --------------------------------------------------------------------
def enter(cgroup: str | None, rlimit_as: int | None) -> str:
    """Put this process under the limit: into `cgroup` when it exists here, else RLIMIT_AS (hard
    too, so nothing it runs can raise it). Returns what was done."""
    if cgroup and Path(cgroup, "cgroup.procs").is_file():
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
        return f"cgroup {cgroup}"
    if rlimit_as:
        resource.setrlimit(resource.RLIMIT_AS, (rlimit_as, rlimit_as))
        return f"RLIMIT_AS {rlimit_as}"
    return "none"


def enter_from_env() -> None:
    """Ray's worker_process_setup_hook for a job's actors (runtime/run.py sets it when the job
    process has a limit)."""
    rlimit = os.environ.get(RLIMIT_ENV, "")
    enter(os.environ.get(CGROUP_ENV), int(rlimit) if rlimit.isdigit() else None)


def main(argv: list[str]) -> None:
    """`python -m lockstep.memlimit -- CMD...`: enter the limit named by the environment, then exec CMD."""
    if not argv or argv[0] != "--" or len(argv) < 2:
        sys.exit("usage: python -m lockstep.memlimit -- CMD [ARGS...]")
    enter_from_env()
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
