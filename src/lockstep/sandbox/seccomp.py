"""The seccomp filter every sandbox runs under (bwrap --seccomp): system calls that no
model-written program needs and that widen the kernel surface answer EPERM, and sockets of any
family but AF_UNIX answer EAFNOSUPPORT.

The namespaces already contain these (a ptrace can only reach the sandbox's own processes, a
mount needs privileges it lacks); the filter removes them outright, so that a kernel bug behind
one of them is out of reach. System V IPC goes whole: a message queue or semaphore set lives in
the IPC namespace, outside every process's memory (msgmnb x msgmni is ~500 MiB a sandbox), and
nothing a program needs uses it (multiprocessing's locks are POSIX semaphores in /dev/shm).
Sockets: the network namespace has only a loopback, but a socket of another family (AF_INET on
that loopback, AF_VSOCK, AF_NETLINK, AF_PACKET, ...) is kernel surface and buffer memory no
program here needs; AF_UNIX stays (asyncio's self-pipe and multiprocessing use it). Another
architecture's system calls (int 0x80, x32) kill the thread: libseccomp's default for a foreign
architecture. Built once per process with libseccomp (through pyseccomp, its
ctypes binding) and handed to each bwrap on a pipe.
"""

from __future__ import annotations

import errno
import functools
import os
import socket
import tempfile

from lockstep.sandbox.types import SandboxUnavailable

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",  # other processes' memory
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr",  # file systems
    "unshare", "setns", "clone3",  # new namespaces (bwrap --disable-userns too); clone3 falls back to clone
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",  # kernel subsystems with a history of exploits
    # Memory outside every file system and process size: System V objects live in the IPC
    # namespace (no rlimit, no tmpfs size), memfds in no file system (only RLIMIT_FSIZE each).
    "shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop",
    "semtimedop", "semctl", "ipc", "memfd_create", "memfd_secret",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "syslog", "personality", "name_to_handle_at", "open_by_handle_at",
    "lookup_dcookie", "iopl", "ioperm",
)
SOCKET_CALLS = ("socket", "socketpair")
"""Refused unless their first argument (the family) is AF_UNIX."""


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
    for name in SOCKET_CALLS:  # compared as 64 bits: a family with high bits set is refused too
        f.add_rule(pyseccomp.ERRNO(errno.EAFNOSUPPORT), name, pyseccomp.Arg(0, pyseccomp.NE, socket.AF_UNIX))
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
