# Attacks the teardown: forks a child that busy-loops forever (ignoring SIGXCPU, SIGTERM and SIGHUP,
# under a name the host looks for), and returns while it spins on. The host checks that it is gone
# once the episode is over. solve() returns 1 if the spinner shares the host's PID namespace (it
# can see the test's own pid), the condition for it to outlive the sandbox.
import os

HOST_PID = int("@HOST_PID@")
SPIN = ("import signal\n"
        "for s in (signal.SIGXCPU, signal.SIGTERM, signal.SIGHUP): signal.signal(s, signal.SIG_IGN)\n"
        "while True: pass\n")


def solve():
    pid = os.fork()
    if pid == 0:
        try:
            os.execv("/usr/bin/python3", ["python3", "-c", SPIN, "@MARKER@-spinner"])
        finally:
            os._exit(0)
    return 1 if os.path.exists(f"/proc/{HOST_PID}/status") and HOST_PID > 100 else 0
