# Attacks the supervisor and its neighbours: SIGKILL to its parent, to a host process of the same
# outer uid (the victim, whose pid the test gives), then kill(-1, SIGKILL): every process it may
# signal. Other sandboxes running at the same time share that uid: they must not be touched.
# solve() returns 1 if the victim was visible to it.
import os
import signal

VICTIM = int("@VICTIM_PID@")


def solve():
    try:
        os.kill(VICTIM, 0)
        seen = True
    except OSError:
        seen = False
    for pid in (VICTIM, os.getppid(), 1):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if seen:
        return 1
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass
    return 0
