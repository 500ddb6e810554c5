"""Plain data: the strict codec of the values that cross between a graded program and its tests
(sandbox/grading.py).

The supervisor imports it, and its source also runs inside both sandboxes (before
sandbox/callee.py in the program's, before sandbox/harness.py in the tests'), so it is stdlib-only,
self-contained and runs on the sandbox's interpreter (Python >= 3.8).

A value is plain when its type is *exactly* one of None, bool, int, float (nan and infinities
included), complex, str, bytes, bytearray, tuple, list, dict, set, frozenset, range, or a built-in
iterator or generator (carried as its remaining items and rebuilt as a list iterator), nested at
most MAX_DEPTH deep, within a byte budget. Subclasses and every other object are refused
(NotPlain): the decoder builds only those exact built-in types, so no code of the program's runs
where a decoded value is compared. Identity and shared references are not kept: a value arrives as
a tree of copies.

The wire form of a value is a JSON array `[tag, ...]`. Ints travel as hex (no 4,300-digit limit),
floats as `float.hex` (exact, nan and inf included), bytes as base64.

Written here rather than taken from a library because none fits: json loses tuples, sets, int
keys, bytes and nan; pickle runs the sender's code on load; repr/eval or ast.literal_eval trust the
sender's repr and bound neither size nor depth (literal_eval has no nan, inf, frozenset or range).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import re
import types

MAX_DEPTH = 48
"""Deepest nesting of containers (a value that contains itself ends here)."""
FRAME = "\n@@lockstep-frame@@"
"""Precedes the program's sandbox's answer on its stdout (sandbox/callee.py)."""

_HEX = re.compile(r"-?0x[0-9a-f]+")
_SEQS = {"t": tuple, "l": list, "S": set, "z": frozenset}
_SEQ_TAGS = {tuple: "t", list: "l", set: "S", frozenset: "z"}
_ITERATORS = {type(iter(x)) for x in ([], (), "", b"", bytearray(), range(0), {}, set(), {}.keys(), {}.values(),
                                      {}.items(), reversed([]), reversed(range(0)))}
_ITERATORS |= {map, filter, zip, enumerate, reversed, types.GeneratorType, type(iter(int, 1))}
_ITERATORS |= {t for t in vars(itertools).values() if isinstance(t, type) and hasattr(t, "__next__")}
MUTABLE = (list, dict, set, bytearray)
"""Types whose value after a call is sent back, so that a function that changes its argument in place
can be tested."""


def dumps(obj) -> str:
    """Compact JSON, as every frame and message between the sandboxes is written."""
    return json.dumps(obj, separators=(",", ":"))


class NotPlain(ValueError):
    """A value that is not plain data, or a malformed wire form; the message says what."""


class Encoder:
    """Wire forms of plain values, all of them together within `budget` bytes of JSON. `refs` maps
    id() of objects that travel by name (the tests' stand-ins for the program's functions) to
    that name."""

    def __init__(self, budget: int, refs: dict | None = None):
        self.budget, self.left, self.refs = budget, budget, refs or {}

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise NotPlain(f"more than {self.budget} bytes of data (the cap follows env.sandbox.output_kb)")

    def _hex(self, text: str) -> str:
        self.spend(len(text) + 4)  # its quotes and separator
        return text

    def encode(self, value, depth: int = 0):
        if depth > MAX_DEPTH:
            raise NotPlain(f"nested more than {MAX_DEPTH} deep")
        self.spend(12)  # ["t", ...] and a separator
        t = type(value)
        if value is None:
            return ["N"]
        if t is bool:
            return ["b", value]
        if t is int:
            return ["i", self._hex(hex(value))]
        if t is float:
            return ["f", self._hex(value.hex())]
        if t is complex:
            return ["c", self._hex(value.real.hex()), self._hex(value.imag.hex())]
        if t is str:
            self.spend(len(json.dumps(value)) + 2)
            return ["s", value]
        if t is bytes or t is bytearray:
            text = base64.b64encode(value).decode("ascii")
            self.spend(len(text) + 4)
            return ["y" if t is bytes else "Y", text]
        if t in _SEQ_TAGS:
            return [_SEQ_TAGS[t], [self.encode(x, depth + 1) for x in value]]
        if t is dict:
            pairs = []
            for k, v in value.items():
                self.spend(4)  # the pair's brackets and separator
                pairs.append([self.encode(k, depth + 1), self.encode(v, depth + 1)])
            return ["d", pairs]
        if t is range:
            return ["r", self._hex(hex(value.start)), self._hex(hex(value.stop)), self._hex(hex(value.step))]
        if t in _ITERATORS:
            return ["g", [self.encode(x, depth + 1) for x in value]]
        if id(value) in self.refs:
            return ["@", self.refs[id(value)]]
        raise NotPlain(f"a {_type_name(value)} object is not plain data")


def _type_name(value) -> str:
    try:
        return str(type(value).__name__)[:80]
    except Exception:  # noqa: BLE001 - a hostile metaclass
        return "strange"


def encode(value, budget: int, refs: dict | None = None):
    """The wire form of one value (NotPlain when it is not plain or is over `budget` bytes)."""
    return Encoder(budget, refs).encode(value)


def decode(node, functions=None, *, build: bool = True, depth: int = 0):
    """The value of a wire form. `functions(name)` resolves a function sent by name (None: names are
    refused). With build=False only checks the form (no container is built, so nothing is hashed:
    the supervisor checks what it relays without paying for a hostile program's hash collisions)."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested more than {MAX_DEPTH} deep")
    if type(node) is not list or not node or type(node[0]) is not str:
        raise NotPlain("malformed value")
    tag, args = node[0], node[1:]
    try:
        if tag == "N" and not args:
            return None
        if tag == "b" and len(args) == 1 and type(args[0]) is bool:
            return args[0]
        if tag == "i" and len(args) == 1 and type(args[0]) is str and _HEX.fullmatch(args[0]):
            return int(args[0], 16)
        if tag == "f" and len(args) == 1:
            return _float(args[0])
        if tag == "c" and len(args) == 2:
            return complex(_float(args[0]), _float(args[1]))
        if tag == "s" and len(args) == 1 and type(args[0]) is str:
            return args[0]
        if tag in ("y", "Y") and len(args) == 1 and type(args[0]) is str:
            data = base64.b64decode(args[0].encode("ascii"), validate=True)
            return data if tag == "y" else bytearray(data)
        if tag in _SEQS and len(args) == 1 and type(args[0]) is list:
            items = [decode(x, functions, build=build, depth=depth + 1) for x in args[0]]
            return _SEQS[tag](items) if build else None
        if tag == "g" and len(args) == 1 and type(args[0]) is list:
            items = [decode(x, functions, build=build, depth=depth + 1) for x in args[0]]
            return iter(items) if build else None
        if tag == "d" and len(args) == 1 and type(args[0]) is list:
            return _dict(args[0], functions, build, depth)
        if tag == "r" and len(args) == 3 and all(type(a) is str and _HEX.fullmatch(a) for a in args):
            span = range(*(int(a, 16) for a in args))  # O(1) whatever the bounds; a step of 0 is refused
            return span if build else None
        if tag == "@" and len(args) == 1 and type(args[0]) is str and functions is not None:
            return functions(args[0])
    except (ValueError, TypeError, UnicodeError, binascii.Error, OverflowError) as e:
        if isinstance(e, NotPlain):
            raise
        raise NotPlain(f"malformed value ({e})") from None
    raise NotPlain(f"malformed value (tag {tag[:8]!r})")


def _float(text) -> float:
    if type(text) is not str or len(text) > 40:
        raise NotPlain("malformed float")
    return float.fromhex(text)


def _dict(pairs: list, functions, build: bool, depth: int):
    out = {} if build else None
    for pair in pairs:
        if type(pair) is not list or len(pair) != 2:
            raise NotPlain("malformed dict")
        k = decode(pair[0], functions, build=build, depth=depth + 1)
        v = decode(pair[1], functions, build=build, depth=depth + 1)
        if build:
            out[k] = v  # an unhashable key is a TypeError: refused by the caller
    return out


def check(node, functions=()) -> None:
    """Raise NotPlain unless `node` is a well-formed wire form whose by-name functions (if any) are
    among `functions`."""
    def known(name):
        if name not in functions:
            raise NotPlain(f"{name[:80]!r} is not a function of the program")

    decode(node, known, build=False)


def update_in_place(old, new, depth: int = 0) -> bool:
    """Make `old` (a list, dict, set or bytearray the tests passed to a call) equal to `new`, its value
    after the call, keeping the identity of `old` and of containers inside it where both sides have
    the same type. False when `old` cannot be updated so (then nothing changed)."""
    t = type(old)
    if t is not type(new) or t not in MUTABLE or depth > MAX_DEPTH:
        return False
    if t is list:
        for i in range(min(len(old), len(new))):
            if not update_in_place(old[i], new[i], depth + 1):
                old[i] = new[i]
        if len(new) < len(old):
            del old[len(new):]
        else:
            old.extend(new[len(old):])
    elif t is dict:
        merged = [(k, old[k] if k in old and update_in_place(old[k], v, depth + 1) else v) for k, v in new.items()]
        old.clear()
        old.update(merged)
    elif t is set:
        old.clear()
        old.update(new)
    else:
        old[:] = new
    return True
