# Attacks the grader, not the host: returns an object equal to everything, so that `assert f(x) == y`
# passes for any y. The old judge compared `== LITERAL` outside, on the repr, but ran `==` against a
# computed value in the program's interpreter, where this object's __eq__ decides.
# tests: ["assert solve() == int('1')", "expected = 1\nassert solve() == expected", "assert solve() == [1][0]"]
class _Equal:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False


def solve():
    return _Equal()
