# Attacks memory across processes: RLIMIT_AS is per process, so 8 children each stay under it while
# together holding 6x the limit; only a watch of the whole tree stops it. solve() returns 1 if at
# least 4 children (3x the limit) were holding their memory at once, for half a second.
import os
import time

MB = int("@MEMORY_MB@")


def solve():
    each = MB * 3 // 4
    r, w = os.pipe()
    kids = []
    for _ in range(8):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            try:
                block = b"x" * (each << 20)  # noqa: F841 - held, resident
                os.write(w, b"1")
                time.sleep(60)
            finally:
                os._exit(0)
        kids.append(pid)
    os.close(w)
    holding, deadline = 0, time.monotonic() + 30
    while holding < 4 and time.monotonic() < deadline:
        chunk = os.read(r, 8)
        if not chunk:
            break
        holding += len(chunk)
    if holding < 4:
        return 0
    time.sleep(0.5)
    alive = 0
    for pid in kids:
        try:
            if os.waitpid(pid, os.WNOHANG) == (0, 0):
                alive += 1
        except ChildProcessError:
            pass
    return 1 if alive >= 4 and alive * each > 3 * MB else 0
