# Attacks memory: one process allocates (and fills, so it is resident) many times the memory limit.
# solve() returns 1 only if it held more than the limit.
MB = int("@MEMORY_MB@")


def solve():
    held, total = [], 0
    try:
        while total < 8 * MB:
            held.append(b"x" * (16 << 20))
            total += 16
    except MemoryError:
        pass
    return 1 if total > MB else 0
