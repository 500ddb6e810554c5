# Attacks the grader, not the host: overrides __import__, so that a test's own `import math` gets a
# module whose isclose is always true. The old judge ran such tests in the program's interpreter.
# solve() is wrong (0.0, not 0.5).
# tests: ["import math\nassert math.isclose(solve(), 0.5)", "from math import isclose\nassert isclose(solve(), 0.5, rel_tol=1e-9)"]
import builtins
import types

_import = builtins.__import__
_fake = types.ModuleType("math")
_fake.isclose = lambda *a, **k: True


def _forged_import(name, *args, **kwargs):
    return _fake if name == "math" else _import(name, *args, **kwargs)


builtins.__import__ = _forged_import


def solve():
    return 0.0
