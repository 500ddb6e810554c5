# Attacks the grader, not the host: replaces sys.modules["math"] (and its own `math`) by a module
# whose isclose is always true. MBPP-style tests call `math.isclose` relying on the program's
# `import math`; the old judge ran them in the program's interpreter. solve() is wrong.
# tests: ["assert math.isclose(solve(), 0.25)", "import math\nassert math.isclose(solve(), 0.75)"]
import math
import sys
import types

_fake = types.ModuleType("math")
_fake.isclose = lambda *a, **k: True
sys.modules["math"] = math = _fake


def solve():
    return 0.0
