# Attacks the grader, not the host: solve() raises SystemExit(0). The old launcher answered a cell
# that exited 0 as "ok", so a test that is a statement passed when the program exited in it.
# tests: ["x = solve()\nassert x > 1", "for i in range(3):\n    assert solve() == i + 10"]
import sys


def solve():
    sys.exit(0)
