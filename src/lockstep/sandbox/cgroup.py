"""A cgroup per sandbox: the kernel's bound on a sandbox as a whole, not process by process.

rlimits bound each process, and the supervisor polls the tree's resident memory every 50 ms; what
neither sees is memory outside any process's resident set (socket buffers, pipe buffers, kernel
objects), bursts between two polls, and CPU spread over many threads and processes. A cgroup's
limits are enforced by the kernel at every allocation and fork:

- memory: `memory_max_mb(limits)`, i.e. the tree's memory, its tmpfs and /dev/shm, and KERNEL_MB
  of kernel memory; cgroups charge socket and pipe buffers, page tables and kernel stacks to it
  too. Over it the kernel refuses the allocation or OOM-kills inside the cgroup alone (the verdict
  says limit "memory"). No swap.
- pids: `limits.processes` + 1 (bwrap's init in the PID namespace), threads included.
- cpu: CPUS cores' worth of time, whatever the number of threads.
- freezer (v2 only): an idle interpreter between two tool calls is frozen (Sandbox.pause); on v1
  its processes are SIGSTOPped instead, listed by the cgroup.

cgroup v2 is used where its memory, pids and cpu controllers can be had: a directory the operator
delegated (LOCKSTEP_SANDBOX_CGROUP), our own cgroup when it already hands them down, or, as root
at the root of a cgroup namespace (a container), after moving that root's processes into a leaf
(the "no internal processes" rule). Otherwise cgroup v1 (memory and pids hierarchies, cpu when
mounted), as on hosts still mounting the v1 controllers. Otherwise no cgroup: the
rlimits and the memory watch alone, and a warning at start saying why. Sandbox cgroups are made
in a "lockstep-sandboxes" directory under our own cgroup (v1's cpu: in ours, so that each sandbox
weighs one process in the scheduler, as before), and removed after the run.
"""

from __future__ import annotations

import atexit
import errno
import functools
import itertools
import logging
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from lockstep import cgroupfs
from lockstep.cgroupfs import mounts, own_paths
from lockstep.sandbox.types import Limits, SandboxError

log = logging.getLogger("lockstep.sandbox")

ENV = "LOCKSTEP_SANDBOX_CGROUP"
"""Unset: found automatically; "off": no cgroup; else a cgroup v2 directory delegated to lockstep."""
PARENT = "lockstep-sandboxes"
KERNEL_MB = 64
"""Kernel memory a sandbox may hold on top of its processes' and files' (page tables, stacks,
socket and pipe buffers)."""
SHM_MB = 8
"""The sandbox's /dev/shm (bwrap.py mounts it this size)."""
CPUS = 1
"""Cores' worth of CPU time a sandbox gets at most, however many threads it runs."""
PERIOD_US = 100_000
V2_NEED = ("memory", "pids", "cpu")
V1_NEED = ("memory", "pids")
V1_OPTIONAL = ("cpu",)
"""No v1 freezer: it holds a frozen task even against SIGKILL, so a sandbox frozen when its owner
was killed would stay frozen for good (seen: 12 left by a killed test run). v2's lets SIGKILL in."""
SETTLE_S = 5.0
"""How long removing a sandbox's cgroup waits for its killed processes to be gone."""

_names = itertools.count()


def memory_max_mb(limits: Limits) -> int:
    """The cgroup's memory bound for these limits."""
    return limits.memory_mb + limits.tmpfs_mb + SHM_MB + KERNEL_MB


@dataclass(frozen=True)
class Host:
    """Where this process makes sandbox cgroups."""

    version: int
    """2: one unified directory; 1: one directory per controller hierarchy."""
    parents: dict[str, Path]
    """Controller -> the lockstep-owned parent directory (v2: the same directory for all)."""


# -- finding the hierarchies ------------------------------------------------------------------------
def _join(mount: str, root: str, path: str) -> Path | None:
    """The directory of cgroup `path` under a mount of hierarchy root `root` (None if outside it)."""
    if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
        return None
    rel = path[len(root.rstrip("/")):] if root != "/" else path
    return Path(mount + rel) if rel not in ("", "/") else Path(mount)


def _read(path: Path) -> str:
    return path.read_text().strip()


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _mkdir(path: Path) -> None:
    try:
        path.mkdir()
    except FileExistsError:
        pass


def _v2_dir(operator: str) -> tuple[Path | None, str]:
    """(the operator's cgroup v2 directory, else our own; why there is none)."""
    if operator:
        d = Path(operator)
        if not (d / "cgroup.controllers").is_file():
            return None, f"{ENV}={operator} is not a cgroup v2 directory"
        return d, ""
    own = own_paths().get("")
    for mount, root, fstype, _ in mounts():
        if fstype == "cgroup2" and own is not None:
            d = _join(mount, root, own)
            if d is not None and d.is_dir():
                return d, ""
    return None, "no cgroup v2 hierarchy is mounted"


def _delegated(d: Path) -> bool:
    """systemd marks a cgroup it delegated (Delegate=yes) with this extended attribute."""
    for name in ("trusted.delegate", "user.delegate"):
        try:
            if os.getxattr(d, name) == b"1":
                return True
        except OSError:
            pass
    return False


def _enable(d: Path, controllers: tuple[str, ...]) -> None:
    have = set(_read(d / "cgroup.subtree_control").split())
    missing = [c for c in controllers if c not in have]
    if missing:
        _write(d / "cgroup.subtree_control", " ".join("+" + c for c in missing))


def _into_leaf(d: Path) -> None:
    """Move every process of `d` into d/lockstep-host, so that `d` may hand controllers down
    (cgroup v2 lets a non-root cgroup have processes or enabled children, not both). Processes
    forked meanwhile land in `d` again: retried until none is left."""
    leaf = d / "lockstep-host"
    _mkdir(leaf)
    for _ in range(100):
        pids = _read(d / "cgroup.procs").split()
        if not pids:
            return
        for pid in pids:
            try:
                _write(leaf / "cgroup.procs", pid)
            except ProcessLookupError:
                pass
    raise OSError(errno.EBUSY, f"processes keep appearing in {d}")


def _may_take_over(d: Path) -> bool:
    """Whether we may move the processes of `d` into a leaf: as root, when `d` is the root of the
    hierarchy we see (a container's own cgroup namespace: its processes are this container's) or
    a cgroup systemd delegated to us."""
    return os.geteuid() == 0 and (d == _mount_root(d) or _delegated(d))


def _v2(operator: str) -> Host | str:
    d, why = _v2_dir(operator)
    if d is None:
        return why
    available = _read(d / "cgroup.controllers").split()
    missing = [c for c in V2_NEED if c not in available]
    if missing:
        return (f"cgroup v2 at {d} offers {' '.join(available) or 'no controllers'}, not "
                f"{', '.join(missing)} (bound to cgroup v1 hierarchies, or not delegated to this cgroup)")
    real_root = not (d / "cgroup.type").exists()  # the host's root cgroup may have processes and children
    try:
        if operator:
            parent = d
        else:
            if not real_root and not set(V2_NEED) <= set(_read(d / "cgroup.subtree_control").split()):
                if not _may_take_over(d):
                    return (f"cgroup v2 at {d} holds processes and does not hand {', '.join(V2_NEED)} down "
                            f"to child cgroups; set {ENV} to a cgroup v2 directory delegated to lockstep")
                _into_leaf(d)
            _enable(d, V2_NEED)
            parent = d / PARENT
            _mkdir(parent)
        _enable(parent, V2_NEED)
        _try_child(parent)
    except OSError as e:
        return f"cannot set up cgroup v2 under {d}: {e}"
    parents = {c: parent for c in V2_NEED}
    if (parent / "cgroup.freeze").exists():  # Linux >= 5.2
        parents["freezer"] = parent
    return Host(2, parents)


def _try_child(parent: Path) -> None:
    """Make and remove a cgroup in `parent` (OSError when we may not: a directory made by root
    and seen by another user, say)."""
    probe = parent / f"lockstep-{os.getpid()}-probe-{secrets.token_hex(3)}"
    probe.mkdir()
    probe.rmdir()


def _mount_root(d: Path) -> Path | None:
    """The mount point of the cgroup2 hierarchy `d` is in."""
    best = None
    for mount, _, fstype, _ in mounts():
        if fstype == "cgroup2" and (d == Path(mount) or Path(mount) in d.parents):
            best = Path(mount) if best is None or len(mount) > len(str(best)) else best
    return best


def _v1() -> Host | str:
    own, parents = own_paths(), {}
    for mount, root, fstype, options in mounts():
        if fstype != "cgroup":
            continue
        for c in V1_NEED + V1_OPTIONAL:
            if c in options and c in own and c not in parents:
                d = _join(mount, root, own[c])
                if d is not None and d.is_dir():
                    # cpu: beside us, not in a group of their own, which would give all sandboxes
                    # together the weight of one process against every other on the host
                    parents[c] = d if c == "cpu" else d / PARENT
    missing = [c for c in V1_NEED if c not in parents]
    if missing:
        return f"no cgroup v1 hierarchy for {', '.join(missing)} is mounted"
    for c, d in list(parents.items()):
        try:
            _mkdir(d)
            _try_child(d)
        except OSError as e:
            if c in V1_NEED:
                return f"cannot create the cgroup v1 directory {d} ({e})"
            del parents[c]  # cpu: the sandbox goes without a CPU bound
    return Host(1, parents)


_host_lock = threading.Lock()


def host() -> Host | str:
    """Where sandbox cgroups go here, or why there are none (said once, as a warning)."""
    with _host_lock:  # pool threads start sandboxes at once: one look, one warning
        return _host()


@functools.lru_cache(maxsize=1)
def _host() -> Host | str:
    setting = os.environ.get(ENV, "")
    if setting == "off":
        found: Host | str = f"{ENV}=off"
    else:
        try:
            found = _v2(setting)
            if isinstance(found, str) and not setting:
                v1 = _v1()
                if isinstance(v1, Host):
                    log.warning("no usable cgroup v2 for sandboxes (%s): they get cgroup v1 ones", found)
                found = v1 if isinstance(v1, Host) else f"{found}; {v1}"
        except OSError as e:  # an unreadable /proc/self/cgroup or mountinfo
            found = f"cannot read this process's cgroups ({e})"
    if isinstance(found, Host):
        _sweep(found)
        log.info("sandboxes get a cgroup v%d each (%s)", found.version,
                 ", ".join(f"{c}: {p}" for c, p in found.parents.items()))
    else:
        log.warning("sandboxes run without a cgroup: %s. Each process keeps its rlimits and the tree's "
                    "resident memory is polled, but socket and pipe buffers, kernel memory and CPU "
                    "summed over processes are not bounded as a whole", found)
    return found


def _parent(h: Host, d: Path) -> None:
    """Make a parent directory of sandbox cgroups (v2: handing the controllers down)."""
    _mkdir(d)
    if h.version == 2:
        _enable(d, V2_NEED)


@atexit.register
def _remove_parents() -> None:
    """Remove our empty "lockstep-sandboxes" directories as this process exits (one another
    process still uses is not empty, and stays)."""
    h = _host() if _host.cache_info().currsize else None
    if isinstance(h, Host) and not os.environ.get(ENV):  # never the operator's directory
        for d in set(h.parents.values()):
            if d.name == PARENT:
                try:
                    d.rmdir()
                except OSError:
                    pass


def _sweep(h: Host) -> None:
    """Remove sandbox cgroups left by processes that died (empty once their sandboxes died)."""
    for parent in set(h.parents.values()):
        try:
            entries = list(parent.iterdir())
        except OSError:
            continue
        for d in entries:
            parts = d.name.split("-")
            if (len(parts) == 4 and parts[0] == "lockstep" and parts[1].isdigit() and d.is_dir()
                    and not Path(f"/proc/{parts[1]}").exists()):
                try:
                    d.rmdir()
                except OSError:
                    pass


# -- one sandbox's cgroup -------------------------------------------------------------------------
class SandboxCgroup:
    """The cgroup (one directory per hierarchy) of one sandbox: made with its limits written,
    then the sandbox's first process is added before it forks anything."""

    def __init__(self, h: Host, limits: Limits):
        self.host, self.frozen = h, False
        name = f"lockstep-{os.getpid()}-{next(_names)}-{secrets.token_hex(3)}"
        self.dirs = {c: p / name for c, p in h.parents.items()}
        self._unique = list(dict.fromkeys(self.dirs.values()))
        made = []
        try:
            for d in self._unique:
                try:
                    d.mkdir()
                except FileNotFoundError:  # another process removed the empty parent as it exited
                    _parent(h, d.parent)
                    d.mkdir()
                made.append(d)
            self._limit(limits)
        except OSError as e:
            for d in made:
                _rmdir(d)
            raise SandboxError(f"could not create the sandbox's cgroup {self._unique[0]}: {e}") from None
        self._oom_base = 0

    def _limit(self, limits: Limits) -> None:
        mem, pids = memory_max_mb(limits) << 20, limits.processes + 1
        m, p = self.dirs["memory"], self.dirs["pids"]
        _write(p / "pids.max", str(pids))
        if self.host.version == 2:
            _write(m / "memory.max", str(mem))
            if (m / "memory.swap.max").exists():
                _write(m / "memory.swap.max", "0")
            _write(self.dirs["cpu"] / "cpu.max", f"{CPUS * PERIOD_US} {PERIOD_US}")
            return
        _write(m / "memory.limit_in_bytes", str(mem))
        if (m / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swap either
            _write(m / "memory.memsw.limit_in_bytes", str(mem))
        if "cpu" in self.dirs:
            _write(self.dirs["cpu"] / "cpu.cfs_period_us", str(PERIOD_US))
            _write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(CPUS * PERIOD_US))

    def add(self, pid: int) -> None:
        """Move process `pid` (not yet forked anything) into every hierarchy of this cgroup."""
        for d in self._unique:
            _write(d / "cgroup.procs", str(pid))

    def oom_kills(self) -> int:
        """Processes the kernel OOM-killed in this cgroup so far."""
        return cgroupfs.oom_kills(self.dirs["memory"], self.host.version == 2)

    @property
    def can_freeze(self) -> bool:
        """cgroup v2's freezer (Linux >= 5.2), which a fatal signal still gets through."""
        return "freezer" in self.dirs

    def freeze(self) -> bool:
        """Stop every process of the sandbox; True once the kernel says all are frozen."""
        d = self.dirs["freezer"]
        self.frozen = True
        _write(d / "cgroup.freeze", "1")
        return _until(lambda: "frozen 1" in (d / "cgroup.events").read_text().splitlines())

    def thaw(self) -> None:
        if self.frozen:
            _write(self.dirs["freezer"] / "cgroup.freeze", "0")
            self.frozen = False

    def procs(self) -> list[int]:
        return sorted({pid for d in self._unique for pid in cgroupfs.procs(d)})

    def remove(self) -> None:
        """Kill whatever is left in the cgroup, wait for it to be gone, remove the directories."""
        try:
            self.thaw()
        except OSError:
            pass
        deadline = time.monotonic() + SETTLE_S
        while (left := self.procs()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.001)
        for d in self._unique:
            _rmdir(d)


def _until(done, timeout_s: float = SETTLE_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def _rmdir(d: Path) -> None:
    for _ in range(200):  # a process that just died may still be leaving the cgroup
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                break
            time.sleep(0.001)
    log.warning("could not remove the sandbox cgroup %s (removed at a later start)", d)


def create(limits: Limits) -> SandboxCgroup | None:
    """A cgroup for a new sandbox, or None on a host without usable cgroups."""
    h = host()
    return SandboxCgroup(h, limits) if isinstance(h, Host) else None


def forget() -> None:
    """Look again at the next host() (after LOCKSTEP_SANDBOX_CGROUP changed: tests, a forced fallback)."""
    with _host_lock:
        _host.cache_clear()
