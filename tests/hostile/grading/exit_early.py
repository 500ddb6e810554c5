# Attacks the grader, not the host: solve() ends the interpreter with status 0 before any assert can
# fail. A judge that trusts the exit status (the program and its tests as one script) passes it;
# the old judge already required each test's own answer. solve() is wrong.
# tests: ["assert solve() == 1", "assert solve() > 0"]
# control: naive
import os


def solve():
    os._exit(0)
