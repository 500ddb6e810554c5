# Attacks the grader, not the host: reads the tests' own variables from the caller's frame. Under
# the old judge a statement test ran in the program's interpreter, so solve() found the expected
# value (`want`) in the frame that called it and returned it.
# tests: ["for x, want in [(1, 11), (2, 22)]:\n    assert solve(x) == want", "want = 33\nassert solve(3) == want"]
import sys


def solve(x):
    frame = sys._getframe(1)
    while frame is not None:
        if "want" in frame.f_locals:
            return frame.f_locals["want"]
        frame = frame.f_back
    return None
