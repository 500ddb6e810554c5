# Attacks memory through anonymous files: memfd_create files are RAM, count against no tmpfs size,
# and are in no process's resident set until mapped. solve() returns 1 if it held more than
# memory_mb + tmpfs_mb in them at once (and stops there, so as not to hurt the host).
import os

MB = int("@MEMORY_MB@")
TMPFS = int("@TMPFS_MB@")


def solve():
    target = MB + TMPFS
    fds, total, chunk = [], 0, b"f" * (4 << 20)
    while total <= target:
        try:
            fd = os.memfd_create("hold")
        except OSError:
            break
        fds.append(fd)
        try:
            for _ in range(2):
                os.write(fd, chunk)
                total += 4
        except OSError:
            break
    return 1 if total > target else 0
