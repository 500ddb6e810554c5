# Attacks the process limit with threads (each is a task the kernel counts): starts threads that
# block until it has more than the limit. solve() returns 1 only if it got more than the limit.
import threading

LIMIT = int("@PROCESSES@")


def solve():
    gate, started = threading.Event(), 0
    for _ in range(4 * LIMIT + 64):
        try:
            t = threading.Thread(target=gate.wait, daemon=True)
            t.start()
        except (RuntimeError, OSError, MemoryError):
            break
        started += 1
    gate.set()
    return 1 if started > LIMIT else 0
