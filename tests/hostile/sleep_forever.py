# Attacks the wall clock: blocks forever without using CPU (so no CPU limit ends it), ignoring
# the signals a polite supervisor would send. It never returns.
import signal
import time


def solve():
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        time.sleep(3600)
