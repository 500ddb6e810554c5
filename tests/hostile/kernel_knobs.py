# Attacks the kernel's privileged interfaces: a new user namespace (the way to capabilities), a new
# mount namespace, mount(2), setuid(0), chroot, and opening /proc/sysrq-trigger and sysctl files for
# writing (opened only, never written). solve() returns 1 if any of it was allowed.
import ctypes
import os

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000


def solve():
    libc = ctypes.CDLL(None, use_errno=True)
    won = 0
    for flags in (CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET):
        pid = os.fork()
        if pid == 0:  # in a child, so that a success changes nothing of the program's own
            os._exit(0 if libc.unshare(flags) == 0 else 1)
        won |= os.waitpid(pid, 0)[1] == 0
    os.makedirs("/tmp/mnt", exist_ok=True)
    won |= libc.mount(b"none", b"/tmp/mnt", b"tmpfs", 0, None) == 0
    for attempt in (lambda: os.setuid(0), lambda: os.chroot("/tmp")):
        pid = os.fork()
        if pid == 0:
            try:
                attempt()
                os._exit(0)
            except OSError:
                os._exit(1)
        won |= os.waitpid(pid, 0)[1] == 0
    for path in ("/proc/sysrq-trigger", "/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches",
                 "/proc/sys/kernel/core_pattern", "/sys/kernel/mm/transparent_hugepage/enabled"):
        try:
            os.close(os.open(path, os.O_WRONLY))
            won = 1
        except OSError:
            pass
    return int(won)
