# Attacks the grader, not the host: rebinds `bool` at top level. The old judge turned a bare
# `assert EXPR` into `bool(EXPR)`, evaluated in the program's namespace, where `bool` is this
# lambda: every bare assert passed. solve(x) is wrong (0, falsy, for every x).
# tests: ["assert solve(3)", "assert solve(4)", "assert bool(solve(5))"]
bool = lambda *a: True  # noqa: E731


def solve(x):
    return 0
