# Attacks the teardown: a classic daemon (fork, setsid, fork again) that ignores SIGHUP and SIGTERM
# and sleeps for ten minutes under a name the host looks for; the host checks that it is gone once
# the episode is over. solve() returns 1 if the daemon shares the host's PID namespace.
import os

HOST_PID = int("@HOST_PID@")
SLEEP = ("import signal, time\n"
         "for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT): signal.signal(s, signal.SIG_IGN)\n"
         "time.sleep(600)\n")


def solve():
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                os.chdir("/")
                os.execv("/usr/bin/python3", ["python3", "-c", SLEEP, "@MARKER@-daemon"])
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return 1 if os.path.exists(f"/proc/{HOST_PID}/status") and HOST_PID > 100 else 0
