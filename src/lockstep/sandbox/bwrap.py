"""The bubblewrap command line of a sandbox, and whether this machine can make one.

What the sandbox sees: the interpreter's install tree read-only (and nothing else of the host's
file system: no /etc, /home, /work, /var), a private size-capped tmpfs at /tmp and a small
/dev/shm as its only writable places (the rest of its root is read-only), its own /proc and a
minimal /dev. New user, PID, IPC, UTS, network, mount and
cgroup namespaces (no network but its own loopback), no nested user namespaces, a new session
(no terminal ioctls on ours), no capabilities, a seccomp filter (sandbox/seccomp.py), and it dies
with the process that started it.

As root, each sandbox is started under an unprivileged uid of its own (sandbox/uids.py; inside it
is always SANDBOX_UID): the kernel does not enforce RLIMIT_NPROC for real uid 0, and sandboxes
sharing an outer uid would share the kernel's per-user budgets. What graders hold is hidden even
where the interpreter's tree would show it: lockstep's own package (the shipped problems'
solutions) and the site-packages of the environment running lockstep are covered by empty
read-only directories.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

from lockstep.sandbox import cgroup, uids
from lockstep.sandbox.seccomp import filter_fd
from lockstep.sandbox.types import SandboxError, SandboxUnavailable

SHM_MB = cgroup.SHM_MB
"""Size of the sandbox's /dev/shm (POSIX shared memory, multiprocessing's semaphores)."""
SANDBOX_UID = 65534
"""The uid ("nobody") a program sees inside; as root its outer uid is one of the pool's (uids.py)."""
TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/alternatives")
"""The host's trees shown read-only (with the interpreter's prefix when it is elsewhere).
/etc/alternatives holds only Debian's symlinks into /usr, through which shared libraries such as
libblas.so.3 (numpy's, for tinker-cookbook's code_rl grader) resolve; the rest of /etc stays hidden."""
NPROC_PER_USERNS = (5, 14)
"""Linux counts RLIMIT_NPROC per user namespace from 5.14 on ("Reimplement RLIMIT_NPROC on top of
ucounts", v5.14-rc1); before, it counts every process of the outer uid on the host."""

UNSAFE_ENV = "LOCKSTEP_SANDBOX_UNSAFE"
"""Set to 1 by an operator to run untrusted code without bubblewrap (rlimits and timeouts only).
Never the default, and never settable by a tenant's job spec."""


def interpreter() -> str:
    """The interpreter sandboxes run: the system's /usr/bin/python3 when there is one (a sandbox runs
    stdlib-only code, and a user's Python under /root or /home may be unreadable to the sandbox's
    uid), else the one behind this process (a venv's python links to it)."""
    system = "/usr/bin/python3"
    if os.access(system, os.X_OK):
        return os.path.realpath(system)
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _trees() -> list[str]:
    """The host directories a sandbox sees (read-only), by their real paths."""
    out = [top for top in TREES if os.path.isdir(top) and not os.path.islink(top)]
    prefix = str(Path(interpreter()).parent.parent)
    if not any(prefix == t or prefix.startswith(t + "/") for t in out):
        out.append(prefix)  # an interpreter installed outside /usr (e.g. /opt/python)
    return out


def _ro_tree() -> list[str]:
    """bwrap arguments that show the interpreter's install tree (and the C library) read-only,
    with the grader's directories in it covered."""
    args = []
    for top in TREES:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
    trees = _trees()
    for tree in trees:
        args += ["--ro-bind", tree, tree]
    for hidden in hidden_paths(trees):
        args += ["--tmpfs", hidden, "--remount-ro", hidden]
    return args


@functools.lru_cache(maxsize=1)
def _grader_paths() -> frozenset[str]:
    """Where the code that grades lives: lockstep's package (envs/data holds the shipped problems'
    solutions) and every site-packages of the environment running it."""
    import lockstep

    found = set(lockstep.__path__) | set(site.getsitepackages())
    found |= {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    if site.ENABLE_USER_SITE:
        found.add(site.getusersitepackages())
    return frozenset(os.path.realpath(p) for p in found)


def hidden_paths(trees: list[str]) -> list[str]:
    """The grader's directories that `trees` would show (outermost only: a directory inside a
    hidden one is hidden with it)."""
    inside = sorted(p for p in _grader_paths() if os.path.isdir(p)
                    and any(p == t or p.startswith(t.rstrip("/") + "/") for t in trees))
    out: list[str] = []
    for p in inside:
        if not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    return out


def bwrap_command(argv: list[str], *, tmpfs_mb: int, env: dict[str, str], seccomp_fd: int | None = None,
                  pooled_uid: bool = False) -> list[str]:
    """The bwrap command line running `argv` in a fresh sandbox (under the seccomp filter read from
    `seccomp_fd`, see sandbox/seccomp.py; `pooled_uid`: started under a uid of the pool, which is
    SANDBOX_UID inside)."""
    # The root and /dev that bwrap builds are tmpfs without a size: made read-only after the
    # mounts, so that the sized /tmp and a small /dev/shm are the only places a program can write.
    cmd = [shutil.which("bwrap") or "bwrap", *_ro_tree(), "--proc", "/proc", "--dev", "/dev",
           "--size", str(tmpfs_mb << 20), "--tmpfs", "/tmp", "--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm",
           "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
           "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
           "--hostname", "sandbox", "--clearenv"]
    if pooled_uid:  # the same uid inside whatever the outer one: a replayed interpreter sees no change
        cmd += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    if seccomp_fd is not None:
        cmd += ["--seccomp", str(seccomp_fd)]
    return cmd + ["--", *argv]


def spawn_user(uid: int | None = None) -> dict:
    """Popen arguments that drop root to `uid` (a lease of the pool; None: SANDBOX_UID), nothing
    when not root."""
    if os.geteuid() != 0:
        return {}
    uid = SANDBOX_UID if uid is None else uid
    return {"user": uid, "group": uid, "extra_groups": []}


def unsafe() -> bool:
    return os.environ.get(UNSAFE_ENV, "") == "1"


def probe() -> str:
    """'' when a sandbox can be made here, else why not. A found bwrap is probed once per path
    (cached); a missing one is looked for again on every call (PATH may change)."""
    path = shutil.which("bwrap")
    if path is None:
        return ("bubblewrap (bwrap) is not installed; install the Debian/Ubuntu package 'bubblewrap' "
                "(scripts/setup.sh does so when run as root)")
    return _probe(path, interpreter())


@functools.lru_cache(maxsize=8)
def _probe(bwrap: str, py: str) -> str:
    if not Path(py).is_file():
        return f"the interpreter {py} is missing"
    try:
        fd = filter_fd()
    except SandboxUnavailable as e:
        return str(e)
    try:
        lease = uids.lease() if uids.pooled() else None
    except SandboxError as e:
        os.close(fd)
        return str(e)
    cmd = bwrap_command([py, "-s", "-B", "-c", "print('ok')"], tmpfs_mb=8, env={"PATH": "/usr/bin:/bin"},
                        seccomp_fd=fd, pooled_uid=lease is not None)
    cmd[0] = bwrap
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd="/", pass_fds=(fd,),
                             **spawn_user(lease and lease.uid))
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap could not start: {e}"
    finally:
        os.close(fd)
        if lease is not None:
            lease.release()
    if out.returncode != 0 or out.stdout.strip() != "ok":
        err = (out.stderr or out.stdout).strip()[-400:]
        return (f"bwrap could not create a sandbox ({err or f'exit {out.returncode}'}); it needs unprivileged "
                f"user namespaces (sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu 24.04 "
                f"kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap), and in a "
                f"container, one allowed to create namespaces")
    return ""


def check_available() -> None:
    """Raise SandboxUnavailable (with the reason and the fix) unless sandboxes can be made here.
    With LOCKSTEP_SANDBOX_UNSAFE=1 this passes: the operator chose to run code unsandboxed."""
    if unsafe():
        return
    reason = probe() or process_limit_problem()
    if reason:
        raise SandboxUnavailable(f"untrusted code is refused: {reason}. Set {UNSAFE_ENV}=1 only if you accept "
                                 f"running model-written code unsandboxed on this machine.")


def kernel_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (int(m[1]), int(m[2])) if m else (0, 0)


def process_limit_problem() -> str:
    """'' when a sandbox's process limit counts that sandbox's processes alone, else why not: it
    does under a pids cgroup, under a uid of its own (root), or where RLIMIT_NPROC is counted per
    user namespace (Linux >= 5.14). Before 5.14, a non-root caller's sandboxes would share one
    count with each other and with all of that user's own processes."""
    h = cgroup.host()
    if (isinstance(h, cgroup.Host) and "pids" in h.parents) or uids.pooled():
        return ""
    kernel = kernel_version()
    if kernel >= NPROC_PER_USERNS:
        return ""
    return (f"the sandbox's process limit would not be its own: Linux {kernel[0]}.{kernel[1]} counts "
            f"RLIMIT_NPROC over every process of uid {os.getuid()} on the host (per user namespace only "
            f"from {NPROC_PER_USERNS[0]}.{NPROC_PER_USERNS[1]}), and there is no pids cgroup here ({h}); run on "
            f"Linux >= {NPROC_PER_USERNS[0]}.{NPROC_PER_USERNS[1]}, as root (a uid per sandbox), or give "
            f"lockstep a cgroup ({cgroup.ENV})")
