# Attacks memory through System V shared memory: segments are created, filled, then detached, so
# that they are in no process's address space or resident set while the (private) IPC namespace
# keeps them. solve() returns 1 if it held more than memory_mb + tmpfs_mb in them at once (and
# stops there, so as not to hurt the host).
import ctypes

MB = int("@MEMORY_MB@")
TMPFS = int("@TMPFS_MB@")
IPC_PRIVATE, IPC_CREAT = 0, 0o1000


def solve():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmdt.argtypes = [ctypes.c_void_p]
    target, total, size = MB + TMPFS, 0, 8 << 20
    while total <= target:
        shmid = libc.shmget(IPC_PRIVATE, ctypes.c_size_t(size), IPC_CREAT | 0o600)
        if shmid < 0:
            break
        addr = libc.shmat(shmid, None, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            break
        ctypes.memset(addr, 0x5A, size)
        libc.shmdt(addr)
        total += 8
    return 1 if total > target else 0
