"""The seccomp filter every sandbox runs under (bwrap --seccomp): system calls that no
model-written program needs and that widen the kernel surface answer EPERM.

The namespaces already contain these (a ptrace can only reach the sandbox's own processes, a
mount needs privileges it lacks); the filter removes them outright, so that a kernel bug behind
one of them is out of reach. Built once per process with libseccomp (through pyseccomp, its
ctypes binding) and handed to each bwrap on a pipe.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

from lockstep.sandbox.types import SandboxUnavailable

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",  # other processes' memory
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr",  # file systems
    "unshare", "setns", "clone3",  # new namespaces (bwrap --disable-userns too); clone3 falls back to clone
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",  # kernel subsystems with a history of exploits
    # Memory outside every file system and process size: System V segments live in the IPC
    # namespace (no rlimit, no tmpfs size), memfds in no file system (only RLIMIT_FSIZE each).
    "shmget", "shmat", "shmctl", "memfd_create", "memfd_secret",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "syslog", "personality", "name_to_handle_at", "open_by_handle_at",
    "lookup_dcookie", "iopl", "ioperm",
)


@functools.lru_cache(maxsize=1)
def filter_bytes() -> bytes:
    """The compiled BPF program (SandboxUnavailable when libseccomp cannot be loaded)."""
    try:
        import pyseccomp
    except (ImportError, OSError) as e:
        raise SandboxUnavailable(f"the seccomp filter needs libseccomp (Debian: libseccomp2) and pyseccomp ({e})") from None
    f = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
    for name in DENIED:
        try:
            f.add_rule(pyseccomp.ERRNO(errno.ENOSYS if name == "clone3" else errno.EPERM), name)
        except (ValueError, OSError, RuntimeError):
            pass  # not a system call on this architecture
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def filter_fd() -> int:
    """A pipe's read end holding the filter, for one bwrap to read (the caller closes it)."""
    data = filter_bytes()
    r, w = os.pipe()
    try:
        os.write(w, data)  # far below a pipe's buffer: a few hundred bytes
    finally:
        os.close(w)
    return r
