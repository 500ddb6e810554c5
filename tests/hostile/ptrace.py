# Attacks other processes with ptrace: PTRACE_ATTACH (through ctypes) to the host's victim process
# (same outer uid), to the test process, to pid 1 and to its parent. solve() returns 1 if it
# attached to a process that is not its own sandbox's (the sandbox's init is bubblewrap).
import ctypes
import os

VICTIM = int("@VICTIM_PID@")
HOST_PID = int("@HOST_PID@")
PTRACE_ATTACH, PTRACE_DETACH = 16, 17


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def solve():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    won = 0
    for pid in (VICTIM, HOST_PID, 1, os.getppid()):
        if libc.ptrace(PTRACE_ATTACH, pid, None, None) == 0:
            if pid in (VICTIM, HOST_PID) or _comm(pid) != "bwrap":
                won = 1
            try:
                os.waitpid(pid, 0x40000000)  # __WALL: the attach stop
            except OSError:
                pass
            libc.ptrace(PTRACE_DETACH, pid, None, None)
    return won
