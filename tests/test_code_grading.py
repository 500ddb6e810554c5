"""Grading with the tests in a sandbox of their own (sandbox/grading.py): the plain-data codec, every
supported form of test (a right program passes each, a wrong one fails each), the forms that fail
closed, the bounds (a test's time, a crash or a limit in either sandbox), and a hostile program
that answers for the grader's own code in its interpreter.

The attacks on the verdict, each with its control, are tests/hostile/grading/ (run by
tests/test_sandbox_hostile.py)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from required import require_sandbox

from lockstep.sandbox.grading import MAX_VALUE_BYTES, grade, value_budget
from lockstep.sandbox.plain import (
    MAX_DEPTH,
    Encoder,
    NotPlain,
    check,
    decode,
    encode,
    update_in_place,
)
from lockstep.sandbox.pool import close_pools
from lockstep.sandbox.types import Limits

LIMITS = Limits(wall_s=3, cpu_s=2, memory_mb=256)
BUDGET = 1 << 16


def run(program: str, tests: list[str], *, entry_point: str = "", limits: Limits = LIMITS):
    require_sandbox(hostile=False)
    graded = asyncio.run(grade(program, tests, limits, entry_point=entry_point))
    close_pools()  # the grading pools keep primed sandboxes: none outlives a test
    assert len(graded.passed) == len(graded.details) == len(tests)
    return graded


# -- the codec --------------------------------------------------------------------------------------------
def same(a, b) -> bool:
    """Equal, of exactly the same types all the way down (nan equal to nan)."""
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if type(a) is float and math.isnan(a):
        return math.isnan(b)
    if type(a) is float:
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


PLAIN = [None, True, False, 0, -1, 2 ** 200, -(7 ** 6000), 1.5, -0.0, float("nan"), float("inf"), -float("inf"),
         5e-324, complex(1, -2), "", "h\xe9llo\x00\ud800\U0001f600", b"\x00\xff", bytearray(b"ab"), (), (1, (2,)),
         [1, [2, [3, []]]], {1: "a", "b": (1, 2), (1, 2): None, frozenset({1}): 2, 2.5: [3]}, {1, 2.5, "x", (1,)},
         frozenset(), frozenset({b"x"}), range(0, 10, 3), range(-5), [True, 1, 1.0]]


@pytest.mark.parametrize("value", PLAIN, ids=lambda v: type(v).__name__)
def test_plain_values_round_trip_exactly(value):
    node = encode(value, BUDGET)
    check(node)
    assert same(decode(node), value)


def test_iterators_arrive_as_list_iterators_of_their_items():
    made = {"list_iterator": lambda: iter([1, 2]), "generator": lambda: (x for x in (1, 2)),
            "map": lambda: map(int, "12"), "zip": lambda: zip([1, 2]), "reversed": lambda: reversed([2, 1]),
            "enumerate": lambda: enumerate("ab"), "itertools.count": lambda: __import__("itertools").islice(
                __import__("itertools").count(), 3)}
    for name, make in made.items():
        back = decode(encode(make(), BUDGET))
        assert type(back) is type(iter([])) and list(back) == list(make()), name


class _Int(int):
    pass


class _Str(str):
    pass


class _List(list):
    pass


class _Dict(dict):
    pass


class _Equal:
    def __eq__(self, other):
        return True


def _cyclic():
    xs = []
    xs.append(xs)
    return xs


NOT_PLAIN = {"int subclass": _Int(1), "str subclass": _Str("a"), "list subclass": _List([1]),
             "dict subclass": _Dict(a=1), "object": object(), "custom __eq__": _Equal(), "function": len,
             "module": math, "inside a list": [1, [_Equal()]], "as a dict key": {_Int(1): 1},
             "dict view": {}.keys(), "cycle": _cyclic()}


@pytest.mark.parametrize("name", list(NOT_PLAIN))
def test_what_is_not_plain_is_refused(name):
    with pytest.raises(NotPlain):
        encode(NOT_PLAIN[name], BUDGET)


@pytest.mark.parametrize("value", PLAIN + [[1.5e300] * 100, [complex(-1e-300, 2)] * 50, [range(-2 ** 70, 2 ** 70)] * 30,
                                   ["\x01\ud800" * 50] * 10, {i: -i for i in range(200)}],
                         ids=lambda v: type(v).__name__)
def test_the_budget_bounds_the_json(value):
    """What the encoder charges is at least the JSON it makes (the frames must fit output_kb)."""
    enc = Encoder(1 << 20)
    node = enc.encode(value)
    assert len(json.dumps(node)) <= (1 << 20) - enc.left


def test_depth_and_size_are_bounded():
    deep = []
    for _ in range(MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(NotPlain, match=f"nested more than {MAX_DEPTH} deep"):
        encode(deep, BUDGET)
    with pytest.raises(NotPlain, match="more than 100 bytes"):
        encode("x" * 200, 100)
    with pytest.raises(NotPlain, match="more than 100 bytes"):
        encode(iter(range(10 ** 9)), 100)  # an endless iterator stops at the budget
    assert decode(encode("x" * 80, 100)) == "x" * 80


MALFORMED = [[], "N", ["N", 1], ["i", "12"], ["i", 12], ["i", "0x1g"], ["b", 1], ["f", "x" * 50], ["f", "one"],
             ["s", 3], ["y", "!!"], ["l", "abc"], ["d", [[["N"]]]], ["r", "0x0", "0x1", "0x0"], ["@", "f"],
             ["Q", []], ["l", [["l", [["q"]]]]]]


@pytest.mark.parametrize("node", MALFORMED, ids=repr)
def test_malformed_wire_forms_are_refused(node):
    with pytest.raises(NotPlain):
        check(node)
    with pytest.raises(NotPlain):
        decode(node)


def test_the_supervisor_checks_without_hashing():
    """check() does not build containers (a hostile program's colliding keys cost the tests'
    sandbox, not the supervisor); an unhashable key is then refused where values are built."""
    node = ["S", [["l", []]]]
    check(node)
    with pytest.raises(NotPlain):
        decode(node)
    with pytest.raises(NotPlain):
        decode(["d", [[["l", []], ["N"]]]])


def test_functions_travel_by_name_only_where_allowed():
    proxy = lambda: None  # noqa: E731
    node = encode([1, proxy], BUDGET, refs={id(proxy): "f"})
    assert node == ["l", [["i", "0x1"], ["@", "f"]]]
    check(node, {"f"})
    with pytest.raises(NotPlain):
        check(node)  # results and values never carry functions
    with pytest.raises(NotPlain):
        check(node, {"g"})  # only the program's own functions
    assert decode(node, lambda name: name.upper()) == [1, "F"]


def test_update_in_place_keeps_identities():
    inner = [3, 1]
    xs = [inner, {"k": [1]}, 5]
    kept = xs[1]["k"]
    assert update_in_place(xs, [[1, 3], {"k": [1, 2], "z": 0}, 6, 7])
    assert xs == [[1, 3], {"k": [1, 2], "z": 0}, 6, 7]
    assert xs[0] is inner and xs[1]["k"] is kept
    d = {"b": 1, "a": 2}
    assert update_in_place(d, {"a": 2, "c": 3}) and list(d.items()) == [("a", 2), ("c", 3)]
    s, b = {1, 2}, bytearray(b"xy")
    assert update_in_place(s, {3}) and s == {3}
    assert update_in_place(b, bytearray(b"z")) and b == bytearray(b"z")
    assert not update_in_place([1], (1,)) and not update_in_place((1,), (2,))


def test_value_budget_follows_the_output_cap():
    assert value_budget(Limits()) == 32 * 1024 - 256
    assert value_budget(Limits(output_kb=1024)) == MAX_VALUE_BYTES
    assert value_budget(Limits(output_kb=1)) == 256


# -- every supported form of test ----------------------------------------------------------------------
RIGHT = '''
import math
from collections import Counter
SCALE = 10
class NegativeError(ValueError):
    pass
def add(a, b):
    return a + b
def halve(x):
    return x / 2
def evens(xs):
    return [x for x in xs if x % 2 == 0]
def squares_map(n):
    return {i: i * i for i in range(n)}
def uniq(xs):
    return set(xs)
def sort_in_place(xs):
    xs.sort()
def fill(d, key):
    d[key] = len(d)
def check_positive(x):
    if x < 0:
        raise NegativeError(f"{x} < 0")
    return x
def lookup(d, k):
    return d[k]
def squares(n):
    return (i * i for i in range(n))
def greet(name):
    print(f"hello {name}")
def fact(n):
    return math.factorial(n)
def apply(f, x):
    return f(x)
def as_tuple(a, b):
    return (a, b)
def nan():
    return float("nan")
def to_bytes(s):
    return s.encode()
def count(s):
    return dict(Counter(s))
def kw(a, *, scale=1):
    return a * scale
'''

WRONG = '''
import math
SCALE = 10
class NegativeError(ValueError):
    pass
def add(a, b):
    return a - b
def halve(x):
    return x // 2
def evens(xs):
    return [x for x in xs if x % 2]
def squares_map(n):
    return {i: i for i in range(n)}
def uniq(xs):
    return list(xs)
def sort_in_place(xs):
    return sorted(xs)
def fill(d, key):
    return {key: len(d)}
def check_positive(x):
    return x
def lookup(d, k):
    return d.get(k, 0) or 0
def squares(n):
    return (i for i in range(n))
def greet(name):
    print(f"hi {name}")
def fact(n):
    return math.factorial(n - 1)
def apply(f, x):
    return x
def as_tuple(a, b):
    return [a, b]
def nan():
    return 0.0
def to_bytes(s):
    return s.encode("latin-1")
def count(s):
    return {c: 1 for c in s}
def kw(a, *, scale=1):
    return a + scale
'''

FORMS = {
    "== literal": "assert add(2, 3) == 5",
    "bare assert": "assert add(1, 1)",
    "assert not": "assert not add(1, -1)",
    "< and >": "assert add(1, 2) < 4 and add(1, 2) > 2",
    "!=": "assert add(5, 4) != 1",
    "== computed": "assert add(2, 2) == add(1, 3)",
    "math.isclose, the program's import": "assert math.isclose(halve(1), 0.5)",
    "set(f(x)) == set([...])": "assert set(evens([1, 2, 3, 4])) == set([2, 4])",
    "lists": "assert evens([1, 2, 3, 4]) == [2, 4] and evens([]) == []",
    "dict with int keys": "assert squares_map(3) == {0: 0, 1: 1, 2: 4}",
    "set": "assert uniq([1, 1, 2]) == {1, 2}",
    "a loop": "for n in range(5):\n    assert add(n, n) == 2 * n",
    "a helper": "def twice(x):\n    return add(x, x)\nassert twice(4) == 8",
    "list changed in place": "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
    "dict changed in place": "d = {}\nfill(d, 'a')\nfill(d, 'b')\nassert d == {'a': 0, 'b': 1}",
    "except the built-in base": ("try:\n    check_positive(-1)\nexcept ValueError as e:\n    assert '-1' in str(e)\n"
                                 "else:\n    raise AssertionError('no error')"),
    "except the program's class": "try:\n    check_positive(-2)\nexcept NegativeError:\n    pass\nelse:\n    assert False",
    "except KeyError": "try:\n    lookup({}, 'k')\nexcept KeyError:\n    pass\nelse:\n    assert False",
    "is None": "assert lookup({'k': None}, 'k') is None",
    "a generator": "assert list(squares(4)) == [0, 1, 4, 9]",
    "printed output": ("import io, contextlib\nbuf = io.StringIO()\nwith contextlib.redirect_stdout(buf):\n"
                       "    greet('ada')\nassert buf.getvalue() == 'hello ada\\n', buf.getvalue()"),
    "a 5,736-digit int": "assert fact(2000) == math.factorial(2000)",
    "a program's function passed to another": "assert apply(halve, 5) == 2.5",
    "tuple is not list": "assert as_tuple(1, 2) == (1, 2) and as_tuple(1, 2) != [1, 2]",
    "nan": "r = nan()\nassert r != r and math.isnan(r)",
    "bytes": "assert to_bytes('h\\xe9') == b'h\\xc3\\xa9'",
    "a Counter made a dict": "assert count('aab') == {'a': 2, 'b': 1}",
    "keywords and a copied constant": "assert kw(2, scale=SCALE) == 20",
    "isinstance and type": "assert isinstance(add(1, 2), int) and type(halve(1)) is float",
}


def test_every_supported_form_passes_a_right_program_and_fails_a_wrong_one():
    tests = list(FORMS.values())
    right = run(RIGHT, tests, entry_point="add")
    failing = {name: d for name, ok, d in zip(FORMS, right.passed, right.details) if not ok}
    assert not failing and right.reason == "ok", failing
    wrong = run(WRONG, tests, entry_point="add")
    passing = [name for name, ok in zip(FORMS, wrong.passed) if ok]
    assert not passing and wrong.reason == "failed", passing


def test_an_entry_point_named_like_a_builtin_is_the_programs():
    """A name that would hide a builtin is bound only when it is the problem's entry point."""
    program = "def sorted(xs):\n    return list(reversed(xs))\n"
    tests = ["assert sorted([1, 2, 3]) == [3, 2, 1]"]
    assert run(program, tests, entry_point="sorted").passed == (True,)
    assert run(program, tests).passed == (False,)  # not the entry point: the tests' own sorted


# -- what fails closed -----------------------------------------------------------------------------------
CLOSED = '''
class Box:
    def __init__(self, v):
        self.v = v
    def get(self):
        return self.v
class MyInt(int):
    pass
CONFIG = object()
def make(v):
    return Box(v)
def leave():
    raise SystemExit(0)
def stop(x):
    raise StopIteration
import cmath as math
def big():
    return "x" * 10 ** 6
def spoil(xs):
    xs.append(object())
def sub():
    return MyInt(3)
def ok():
    return 1
'''

CLOSED_TESTS = {
    "an object, caught": ("try:\n    make(1)\nexcept BaseException:\n    pass", "not plain data"),
    "a method of an object": ("assert make(1).get() == 1", "not plain data"),
    "SystemExit, caught": ("try:\n    leave()\nexcept BaseException:\n    pass", "exits"),
    "too much data, caught": ("try:\n    big()\nexcept BaseException:\n    pass", "bytes of data"),
    "an argument spoiled": ("xs = []\ntry:\n    spoil(xs)\nexcept BaseException:\n    pass", "no longer plain data"),
    "an int subclass, caught": ("try:\n    sub()\nexcept BaseException:\n    pass", "not plain data"),
    "a non-plain constant": ("assert CONFIG is not None", "NameError"),
    "a lambda argument, caught": ("try:\n    make(lambda: 1)\nexcept BaseException:\n    pass", "not plain data"),
    "StopIteration ending a map": ("assert all(map(stop, [1, 2])) and not list(filter(stop, [3]))", "StopIteration"),
    "a module under an alias": ("assert math.sqrt(-4) == 2j", "NameError"),
}


def test_unsupported_forms_fail_closed_whatever_the_test_catches():
    tests = [t for t, _ in CLOSED_TESTS.values()] + ["assert ok() == 1"]
    graded = run(CLOSED, tests)
    for (name, (_, why)), ok, detail in zip(CLOSED_TESTS.items(), graded.passed, graded.details):
        assert not ok, name
        assert why in detail, (name, detail)
    assert graded.passed[-1] and graded.reason == "failed"  # refusals are test failures, not crashes


# -- bounds ----------------------------------------------------------------------------------------------
BOUNDS = '''
import os, time
def ok():
    return 1
def nap():
    time.sleep(600)
def die():
    os._exit(3)
def hog():
    return bytearray(1 << 30)
'''

SMALL = Limits(wall_s=2, cpu_s=1, memory_mb=256)


@pytest.mark.parametrize("test, reason", [
    ("nap()", "timeout"),  # a call past the wall clock: A is killed
    ("die()", "crash"),  # the program's interpreter dies in a call
    ("hog()", "violation"),  # a call hits the memory limit
    ("import time\ntime.sleep(600)", "timeout"),  # a test that hangs in B
    ("while True:\n    ok()", "timeout"),  # a test that calls forever: its calls' time counts
], ids=["call-timeout", "call-crash", "call-limit", "test-hangs", "calls-forever"])
def test_a_stopped_test_fails_it_and_the_rest(test, reason):
    graded = run(BOUNDS, ["assert ok() == 1", test, "assert ok() == 1"], limits=SMALL)
    assert graded.passed == (True, False, False) and graded.reason == reason, graded


def test_a_program_that_fails_to_load_passes_nothing():
    assert run("raise ValueError('no')", ["assert True"]).reason == "crash"
    assert run("def f(:", ["assert True"]).reason == "crash"
    graded = run("def g():\n    return 1\n", ["assert True"], entry_point="f")
    assert graded.reason == "missing_entry_point" and graded.passed == (False,)


def test_tests_that_need_no_program_run_in_the_tests_sandbox():
    graded = run("x = 1\n", ["assert x == 1", "assert 1 + 1 == 2", "assert False", "import os\nassert os.getpid() > 0"])
    assert graded.passed == (True, True, False, True) and graded.reason == "failed"


def test_what_crosses_fits_a_small_output_cap():
    """Both sandboxes answer on stdout, capped at output_kb: a program with many names and large
    values, many failing tests with long messages and calls near the value budget still end as
    failed tests, never as an output violation; the entry point is named first."""
    small = Limits(wall_s=3, cpu_s=2, memory_mb=256, output_kb=2)
    program = "".join(f"def f{i}_{'x' * 40}(a):\n    return a\n" for i in range(300))
    program += "TABLE = list(range(10000))\ndef echo(a):\n    return a\n"
    tests = [f"assert False, {'m' * 400!r}" for _ in range(30)]
    tests += [f"assert echo({'y' * (value_budget(small) - 64)!r}) == 1", "assert echo([1] * 10000) == 1",
              "assert echo(2) == 2"]
    graded = run(program, tests, entry_point="echo", limits=small)
    assert graded.reason == "failed" and graded.passed == (False,) * 32 + (True,), graded.reason
    assert "bytes of data" in graded.details[31]


# -- a hostile program against the grader's code in its own interpreter -----------------------------------
FORGED_MANIFEST = '''
import json as _json, os as _os, sys as _sys

def _forged(ns, *args):  # replaces the grader's own code in this interpreter: it names what it likes
    names = [["__builtins__", ["val", ["d", []]]], ["isinstance", ["fn"]], ["len", ["fn"]], ["solve", ["fn"]],
             ["__name__", ["val", ["s", "x"]]], ["class", ["fn"]], ["bad", ["val", ["q"]]], [1, ["fn"]]]
    _os.write(1, ("\\n@@lockstep-frame@@" + _json.dumps({"names": names}) + "\\n").encode())

_sys.modules["_lockstep_callee"].manifest = _forged

def isinstance(*args):
    return True

def len(*args):
    return 5

def solve():
    return "x"
'''


def test_a_forged_manifest_binds_no_builtin_and_no_dunder():
    """The program answers the grader's "name your functions" itself: names that would hide a
    builtin, dunder names and malformed entries are dropped (by the supervisor and by the tests'
    sandbox), so the tests keep their own isinstance, len and __builtins__."""
    tests = ["assert isinstance(solve(), int)", "assert len(solve()) == 5",
             "assert type(__builtins__).__name__ == 'module' and __name__ == '__main__'", "assert solve() == 'x'"]
    graded = run(FORGED_MANIFEST, tests, entry_point="solve")
    assert graded.passed == (False, False, True, True), graded
