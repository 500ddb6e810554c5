"""A uid of its own for every running sandbox (when lockstep runs as root).

Why: PID namespaces already keep one sandbox's kill() and ptrace from another's processes, but
the kernel keeps some counters per user of the *initial* namespace, whatever namespace a process
is in: inotify instances and watches (fs.inotify.max_user_*), POSIX message-queue bytes and
pending signals (the sandbox's user namespace records its creator's RLIMIT_MSGQUEUE and
RLIMIT_SIGPENDING as the ceiling of the outer uid's count), pipe buffers (fs.pipe-user-pages-*),
Unix-socket file descriptors in flight, and before Linux 5.14 the process count of RLIMIT_NPROC.
Sandboxes sharing one outer uid share those budgets, so one could starve its neighbours (or the
host's own "nobody" daemons) of them. Each sandbox therefore runs as a uid from a range that no
user or subordinate-uid range uses by default, taken for as long as its processes may live.

Leases are flock()s on one file per uid under LEASE_DIR, so that every process of the host
(several env workers, several jobs) draws from the same pool, and a lease dies with its holder.
Not root: no pool (the kernel only lets root switch uids); every sandbox runs as the caller's uid.
"""

from __future__ import annotations

import fcntl
import os
import stat
import threading
from dataclasses import dataclass

from lockstep.sandbox.types import SandboxError, SandboxUnavailable

RANGE_ENV = "LOCKSTEP_SANDBOX_UIDS"
"""BASE:COUNT, set by an operator whose host already uses the default range."""
DEFAULT_BASE, DEFAULT_COUNT = 90000, 4096
"""Above the 16-bit uids (and 65534, "nobody"), below 100000, where useradd starts subordinate
uid ranges (/etc/subuid) and rootless containers map theirs; systemd leaves 65536-524287 unused."""
LEASE_DIR = "/run/lockstep-sandbox-uids"

_cursor = 0
_cursor_lock = threading.Lock()


@dataclass
class Lease:
    """One uid, held until release() (or until this process exits)."""

    uid: int
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # drops the flock
            self.fd = -1


def uid_range() -> range:
    """The pool's uids (SandboxUnavailable when the operator's LOCKSTEP_SANDBOX_UIDS is malformed)."""
    raw = os.environ.get(RANGE_ENV, "")
    if not raw:
        return range(DEFAULT_BASE, DEFAULT_BASE + DEFAULT_COUNT)
    try:
        base, count = (int(x) for x in raw.split(":"))
    except ValueError:
        base = count = -1
    if not (1000 <= base and 1 <= count <= 65536 and base + count <= 2**31 - 1) or 65534 in range(base, base + count):
        raise SandboxUnavailable(f"{RANGE_ENV}={raw!r}: expected BASE:COUNT with BASE >= 1000, COUNT in "
                                 f"[1, 65536], below 2^31 and not including 65534")
    return range(base, base + count)


def pooled() -> bool:
    """Whether sandboxes get uids from the pool here (only root can give them)."""
    return os.geteuid() == 0


def _lease_dir() -> str:
    """LEASE_DIR, made root-only and checked: a lease file that someone else could swap for a
    symlink or pre-lock would hand out a uid twice."""
    try:
        os.mkdir(LEASE_DIR, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise SandboxUnavailable(f"cannot create {LEASE_DIR} for the sandbox uid pool: {e}") from None
    st = os.lstat(LEASE_DIR)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
        raise SandboxUnavailable(f"{LEASE_DIR} must be a directory owned by root with mode 0700 "
                                 f"(the sandbox uid pool keeps its leases there)")
    return LEASE_DIR


def lease() -> Lease:
    """A free uid of the pool, locked for the caller (SandboxError when all are taken)."""
    global _cursor
    uids, lease_dir = uid_range(), _lease_dir()
    with _cursor_lock:
        start = _cursor
        _cursor = (_cursor + 1) % len(uids)
    for k in range(len(uids)):  # from this process's cursor, so that concurrent takers rarely collide
        uid = uids[(start + k) % len(uids)]
        fd = os.open(f"{lease_dir}/{uid}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return Lease(uid, fd)
    raise SandboxError(f"all {len(uids)} sandbox uids ({uids.start}-{uids.stop - 1}) are in use; "
                       f"set {RANGE_ENV}=BASE:COUNT to a larger free range")


def in_pool(uid: int) -> bool:
    try:
        return uid in uid_range()
    except SandboxUnavailable:
        return False
