# Attacks the supervisor's memory through output: 8 MiB to stdout and 8 MiB to stderr, through
# print and straight to the file descriptors. solve() returns 1 if all of it was taken.
import os
import sys


def solve():
    line = "A" * 65535 + "\n"
    for _ in range(64):
        print(line, end="")
        print(line, end="", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    block = b"B" * (1 << 20)
    for _ in range(4):
        os.write(1, block)
        os.write(2, block)
    return 1
