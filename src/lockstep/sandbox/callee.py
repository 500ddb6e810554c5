"""Runs inside the graded program's sandbox (A), in the program's own interpreter, after the program:
names what the program defined at top level, then calls its functions for the tests, which run in
another sandbox (sandbox/grading.py). Its source runs after plain.py's, in one module of its own
(`_lockstep_callee`), so it is stdlib-only like the launcher.

Nothing here is trusted: the program ran first and can replace any of it, or write anything on
stdout. That is harmless by construction: the supervisor reads only a frame of plain data from
this sandbox (checked by plain.check), and the verdict is decided in the tests' sandbox, which
receives nothing else. A forged frame is no more than a function returning that value.

Answers, each on stdout after plain.FRAME, as JSON:
  load     -> runs the program, then answers as manifest
  manifest -> {"names": [[name, ["fn"] | ["exc", builtin base] | ["mod", module name] | ["val", value]], ...]}
  call     -> {"value": value} | {"raise": [type name, builtin base, message]} | {"refused": why},
              with "args": [value after the call | None] and "kwargs": [[key, value | None]] for
              the arguments of a mutable type (plain.MUTABLE).
"""

import base64
import builtins
import errno
import json
import os
import sys
import types

if __name__ != "_lockstep_callee":  # imported by the package (tests), not run in a sandbox
    from lockstep.sandbox.plain import FRAME, MUTABLE, Encoder, NotPlain, decode, dumps  # noqa: F401

MAX_NAMES = 1000
"""Top-level names reported at most (the rest are not visible to the tests)."""
MAX_MESSAGE = 500
_LIMIT_ERRNOS = (errno.EFBIG, errno.EMFILE, errno.ENFILE, errno.EAGAIN)
"""As the launcher's: an OSError that is a sandbox limit ends the call there, so the supervisor
counts a violation (env/code_violation), as it did when the tests ran in this interpreter."""


def _emit(obj) -> None:
    try:
        sys.stdout.flush()  # the function's own output first: it is forwarded to the tests
    except Exception:  # noqa: BLE001 - the program may have replaced or closed its streams
        pass
    data = (FRAME + dumps(obj) + "\n").encode("ascii")
    while data:
        data = data[os.write(1, data):]


def _base(cls) -> str:
    """The nearest built-in exception class of `cls` (what a test's `except` can name)."""
    for c in getattr(cls, "__mro__", ()):
        if isinstance(c, type) and getattr(builtins, c.__name__, None) is c and issubclass(c, BaseException):
            return c.__name__
    return "Exception"


def _entry(value, enc: Encoder):
    if isinstance(value, types.ModuleType):
        return ["mod", str(value.__name__)]
    if isinstance(value, type) and issubclass(value, BaseException):
        return ["exc", _base(value)]
    if callable(value):
        return ["fn"]
    return ["val", enc.encode(value)]


def manifest(ns: dict, budget: int, entry_point: str = "") -> None:
    """Report the program's top-level names (dunder names excepted), the entry point first, within
    `budget` bytes: a value that does not fit, or is not plain, is left out (invisible to the tests)."""
    enc, names = Encoder(budget), []
    items = sorted(ns.items(), key=lambda item: item[0] != entry_point)
    for name, value in items:
        if len(names) >= MAX_NAMES:
            break
        if type(name) is not str or not name.isidentifier() or (name.startswith("__") and name.endswith("__")):
            continue
        left = enc.left
        try:
            enc.spend(len(name) + 16)
            names.append([name, _entry(value, enc)])
        except NotPlain:
            enc.left = left
    _emit({"names": names})


def load(ns: dict, program: str, budget: int, entry_point: str) -> None:
    """Run the program (base64) in `ns` as the launcher would run it as a cell, then report its names.
    A SystemExit of status 0 ends the program, not the grading (as `python3 prog.py` would exit 0)."""
    code = compile(base64.b64decode(program).decode("utf-8"), "<program>", "exec")
    try:
        exec(code, ns)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    manifest(ns, budget, entry_point)


def _message(exc) -> str:
    try:
        return str(exc)[:MAX_MESSAGE]
    except Exception:  # noqa: BLE001 - a __str__ that fails
        return ""


def _raised(exc) -> dict:
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in _LIMIT_ERRNOS):
        raise exc  # the launcher labels it a limit: the supervisor stops there
    return {"raise": [str(type(exc).__name__)[:100], _base(type(exc)), _message(exc)]}


def call(ns: dict, request: str) -> None:
    """Call one of the program's functions on plain arguments and answer plain data (see the module
    docstring). `request` is base64 of {"fn", "args", "kwargs", "budget"}."""
    req = json.loads(base64.b64decode(request))
    name = req["fn"]

    def function(ref):
        f = ns.get(ref)
        if not callable(f):
            raise NotPlain(f"{ref} is not a function of the program")
        return f

    try:
        fn = function(name)
        args = [decode(a, function) for a in req["args"]]
        kwargs = {k: decode(v, function) for k, v in req["kwargs"]}
    except NotPlain as e:
        return _emit({"refused": str(e)})
    enc = Encoder(req["budget"])
    try:
        answer = {"value": enc.encode(fn(*args, **kwargs))}
    except NotPlain as e:
        answer = {"refused": f"{name}(): result refused: {e}"}
    except BaseException as e:  # noqa: BLE001 - the function's exception is its answer (a generator's too)
        answer = _raised(e)
    try:
        answer["args"] = [enc.encode(a) if type(a) in MUTABLE else None for a in args]
        answer["kwargs"] = [[k, enc.encode(v) if type(v) in MUTABLE else None] for k, v in kwargs.items()]
    except NotPlain as e:
        answer = {"refused": f"{name}(): an argument is no longer plain data after the call: {e}"}
    _emit(answer)
