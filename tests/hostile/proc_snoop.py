# Attacks process isolation through /proc: lists the processes it can see, and reads the command
# line and status of the test process and the host's victim. solve() returns 1 if it saw more
# than a handful of processes or any of the host's.
import os

HOST_PID = int("@HOST_PID@")
VICTIM = int("@VICTIM_PID@")


def solve():
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    if len(pids) > 5:
        return 1
    for pid in (HOST_PID, VICTIM):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read():
                    return 1
        except OSError:
            pass
    return 0
