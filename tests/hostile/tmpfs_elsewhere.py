# Attacks memory through file systems other than /tmp: bubblewrap's root, /dev and /dev/shm are
# tmpfs too, and what is stored there is host RAM that no process's address space or resident
# set shows (so neither RLIMIT_AS nor the tree's RSS watch sees it). solve() returns 1 if it held
# more than memory_mb + tmpfs_mb in them at once (it stops there, so as not to hurt the host).
import os

MB = int("@MEMORY_MB@")
TMPFS = int("@TMPFS_MB@")


def solve():
    target = MB + TMPFS
    total, chunk, n = 0, b"m" * (4 << 20), 0
    for where in ("/", "/dev/shm", "/dev", "/var/tmp", "/home"):
        try:
            os.makedirs(where, exist_ok=True)
        except OSError:
            continue
        while total <= target:
            try:
                with open(f"{where}/fill-{n}", "wb") as f:
                    f.write(chunk)
            except OSError:
                break
            n += 1
            total += 4
        if total > target:
            return 1
    return 0
