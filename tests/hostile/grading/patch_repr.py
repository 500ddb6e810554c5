# Attacks the grader, not the host: replaces builtins.repr. The old judge read a test's value as the
# repr printed in the program's interpreter, so `assert f(x) is True`, `== True` and bare asserts
# all read "True". solve(x) is wrong (False).
# tests: ["assert solve(1) is True", "assert solve(2) == True", "assert solve(3)"]
import builtins

builtins.repr = lambda obj: "True"


def solve(x):
    return False
