# Attacks the grader, not the host: replaces builtins.isinstance and builtins.type, which tests use
# to check a result's type, for calls made from a test (a cell; the launcher's own calls keep the
# real ones); the old judge ran those tests in the program's interpreter. solve() returns a str
# where the tests want an int.
# tests: ["assert isinstance(solve(), int)", "assert type(solve()) == int", "assert type(solve()) is int"]
import builtins
import sys

_type, _isinstance = builtins.type, builtins.isinstance


def _from_a_test() -> bool:
    return sys._getframe(2).f_code.co_filename == "<cell>"


def _forged_isinstance(obj, cls):
    return True if _from_a_test() else _isinstance(obj, cls)


def _forged_type(*args):
    return int if len(args) == 1 and _from_a_test() else _type(*args)


builtins.isinstance, builtins.type = _forged_isinstance, _forged_type


def solve():
    return "five"
