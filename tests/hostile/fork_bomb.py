# Attacks the process limit: a linear fork bomb whose children all sleep, so that every one is alive
# at once. solve() returns 1 only if it got more children than the sandbox's process limit.
import os
import time

LIMIT = int("@PROCESSES@")


def solve():
    kids = 0
    for _ in range(4 * LIMIT + 64):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        kids += 1
    return 1 if kids > LIMIT else 0
