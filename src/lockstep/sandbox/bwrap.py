"""The bubblewrap command line of a sandbox, and whether this machine can make one.

What the sandbox sees: the interpreter's install tree read-only (and nothing else of the host's
file system: no /etc, /home, /work, /var), a private size-capped tmpfs at /tmp and a small
/dev/shm as its only writable places (the rest of its root is read-only), its own /proc and a
minimal /dev. New user, PID, IPC, UTS, network, mount and
cgroup namespaces (no network but its own loopback), no nested user namespaces, a new session
(no terminal ioctls on ours), no capabilities, a seccomp filter (sandbox/seccomp.py), and it dies
with the process that started it.

As root, the sandbox is started under an unprivileged uid (SANDBOX_UID): the kernel does not
enforce RLIMIT_NPROC for real uid 0, so a fork bomb started from root would not be capped.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from lockstep.sandbox.seccomp import filter_fd
from lockstep.sandbox.types import SandboxUnavailable

SHM_MB = 8
"""Size of the sandbox's /dev/shm (POSIX shared memory, multiprocessing's semaphores)."""
SANDBOX_UID = 65534
"""The outer uid of sandboxes started by root ("nobody"); per-sandbox process counts are kept in
each sandbox's own user namespace, so sandboxes sharing the uid do not share a budget."""

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


def _ro_tree() -> list[str]:
    """bwrap arguments that show the interpreter's install tree (and the C library) read-only."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefix = str(Path(interpreter()).parent.parent)
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        args += ["--ro-bind", prefix, prefix]  # an interpreter installed outside /usr (e.g. /opt/python)
    return args


def bwrap_command(argv: list[str], *, tmpfs_mb: int, env: dict[str, str], seccomp_fd: int | None = None) -> list[str]:
    """The bwrap command line running `argv` in a fresh sandbox (under the seccomp filter read from
    `seccomp_fd`, see sandbox/seccomp.py)."""
    # The root and /dev that bwrap builds are tmpfs without a size: made read-only after the
    # mounts, so that the sized /tmp and a small /dev/shm are the only places a program can write.
    cmd = [shutil.which("bwrap") or "bwrap", *_ro_tree(), "--proc", "/proc", "--dev", "/dev",
           "--size", str(tmpfs_mb << 20), "--tmpfs", "/tmp", "--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm",
           "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
           "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
           "--hostname", "sandbox", "--clearenv"]
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    if seccomp_fd is not None:
        cmd += ["--seccomp", str(seccomp_fd)]
    return cmd + ["--", *argv]


def spawn_user() -> dict:
    """Popen arguments that drop root to SANDBOX_UID (nothing when not root)."""
    if os.geteuid() != 0:
        return {}
    return {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}


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
    cmd = bwrap_command([py, "-s", "-B", "-c", "print('ok')"], tmpfs_mb=8, env={"PATH": "/usr/bin:/bin"}, seccomp_fd=fd)
    cmd[0] = bwrap
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd="/", pass_fds=(fd,), **spawn_user())
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap could not start: {e}"
    finally:
        os.close(fd)
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
    reason = probe()
    if reason:
        raise SandboxUnavailable(f"untrusted code is refused: {reason}. Set {UNSAFE_ENV}=1 only if you accept "
                                 f"running model-written code unsandboxed on this machine.")
