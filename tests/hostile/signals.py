# Attacks other processes with signals: SIGSTOP to pid 1, then SIGSTOP and SIGTERM to every pid from
# 1 to 400 and to the host's victim process (same outer uid). None of the host's may be affected.
# solve() returns 1 if a signal reached the victim.
import os
import signal

VICTIM = int("@VICTIM_PID@")


def solve():
    me, hit = os.getpid(), 0
    try:
        os.kill(1, signal.SIGSTOP)
    except OSError:
        pass
    for pid in [*range(1, 401), VICTIM]:
        if pid == me:
            continue
        for sig in (signal.SIGSTOP, signal.SIGTERM):
            try:
                os.kill(pid, sig)
                hit += pid == VICTIM
            except OSError:
                pass
    return 1 if hit else 0
