"""Runs inside the tests' sandbox (B): a fresh interpreter that never runs the graded program's code.
Its source runs after plain.py's in one module of its own (`_lockstep_harness`), so it is
stdlib-only like the launcher.

The tests run here, one after another in one namespace, with this interpreter's own builtins,
against stand-ins for the program's top-level names (sandbox/callee.py reports them):
  - a function becomes a proxy: calling it sends its arguments as plain data (anything else fails
    the test) for the supervisor to relay to the program's sandbox (A); the result comes back as
    plain data, mutable arguments are updated in place to their value after the call, what the
    function printed is written to this sys.stdout, and an exception it raised is raised here as
    the built-in class of that name or a plain class named after it (deriving from its nearest
    built-in base);
  - a plain value is a copy; a module is this interpreter's own import of the same standard-library
    module, bound only under its own name (not `import cmath as math`); an exception class is a
    plain class of that name;
  - a name that would hide a builtin is not bound (so `bool = lambda *a: True` changes nothing
    here), except the problem's entry point.
A call whose answer is unusable (not plain data, a function that exits or raises StopIteration,
no answer) fails its test whatever the test catches. Each test's verdict is decided here and written on fd 1 after a nonce
that only this sandbox and the supervisor know; everything else written to stdout or stderr goes to
a bounded sink.

Protocol: `Harness(setup)` and `add_tests(chunk)` while the program loads in A, `bind(names)` with
the first step, then one call of `step` per cell: `step(reply, a_wall_s)` hands the relayed answer of the
pending call (base64 JSON, or None) to the test waiting for it, then runs tests until one calls the
program, all are done, the current test has used its `wall_s` (its own time here plus its calls'
time in A, `a_wall_s` each), or this cell has run CELL_SHARE of `wall_s` (the sandbox's own wall
clock then still has room), or its results fill a quarter of the sandbox's output cap. It writes {"state": "call" | "done" | "timeout" | "yield",
"results": [[test index, passed, detail]], "call": {"fn", "args", "kwargs"} | None}.
"""

import base64
import builtins
import importlib
import json
import os
import sys
import threading
import time

if __name__ != "_lockstep_harness":  # imported by the package (tests), not run in a sandbox
    from lockstep.sandbox.plain import MUTABLE, Encoder, NotPlain, decode, dumps, update_in_place  # noqa: F401

CELL_SHARE = 0.8
MAX_DETAIL = 300
SINK_CHARS = 1 << 16


class Refused(BaseException):
    """A call whose answer cannot be used; its test fails whatever the test catches."""


class _Sink:
    """stdout and stderr of the tests: kept up to SINK_CHARS, then dropped."""

    def __init__(self):
        self.kept = 0

    def write(self, text):
        self.kept = min(SINK_CHARS, self.kept + len(text))
        return len(text)

    def flush(self):
        pass


class _Test:
    def __init__(self, index: int):
        self.index, self.spent, self.refused = index, 0.0, ""
        self.finished, self.passed, self.detail = False, False, ""


def _stdlib(module: str) -> bool:
    top = module.split(".")[0]
    names = getattr(sys, "stdlib_module_names", None)
    return top in names if names is not None else top in sys.builtin_module_names


class Harness:
    def __init__(self, setup: str):
        s = json.loads(base64.b64decode(setup))
        self.nonce, self.wall_s, self.budget = s["nonce"], float(s["wall_s"]), int(s["budget"])
        # What one report may hold besides a call's arguments (stdout is capped at out_cap).
        self.results_cap, self.detail_cap = s["out_cap"] // 4, min(MAX_DETAIL, s["out_cap"] // 8)
        self.tests: list[str] = []
        self.ns = {"__name__": "__main__", "__builtins__": builtins}
        self.refs, self.exceptions, self._keep, self.entry_point = {}, {}, [], s["entry_point"]
        self.current, self.next = None, 0
        self._request, self._reply = None, None
        self._lock, self._wake, self._replied = threading.Lock(), threading.Event(), threading.Event()
        sys.stdout = sys.stderr = _Sink()

    def add_tests(self, chunk: str) -> None:
        self.tests += json.loads(base64.b64decode(chunk))

    # -- the program's names ---------------------------------------------------------------------
    def bind(self, names: str) -> None:
        """Bind stand-ins for the program's names (base64 JSON of [name, entry] pairs, sandbox/callee.py)."""
        for name, entry in json.loads(base64.b64decode(names)):
            dunder = name.startswith("__") and name.endswith("__")
            if not dunder and (name not in vars(builtins) or name == self.entry_point):
                self._bind(name, entry)

    def _bind(self, name: str, entry: list) -> None:
        kind = entry[0]
        if kind == "fn":
            self.ns[name] = self._proxy(name)
        elif kind == "exc":
            cls = self._exception_class(name, entry[1])
            if cls is not None:
                self.ns[name] = cls
        elif kind == "mod" and _stdlib(entry[1]) and name in entry[1].split("."):  # never under an alias
            try:
                self.ns[name] = importlib.import_module(entry[1])
            except Exception:  # noqa: BLE001 - not importable here: the name stays unbound
                pass
        elif kind == "val":
            try:
                self.ns[name] = decode(entry[1])
            except NotPlain:
                pass

    def _proxy(self, name: str):
        harness = self

        def proxy(*args, **kwargs):
            return harness._call(name, args, kwargs)

        proxy.__name__ = proxy.__qualname__ = name
        self.refs[id(proxy)] = name
        self._keep.append(proxy)  # its id stays its own while the tests run
        return proxy

    def _exception_class(self, name: str, base: str):
        """The class that stands for the program's exception `name` (None: one whose call fails its
        test whatever the test catches)."""
        if name not in self.exceptions:
            own = getattr(builtins, name, None)
            if isinstance(own, type) and issubclass(own, BaseException):
                cls = own
            else:
                parent = getattr(builtins, base, None)
                parent = parent if isinstance(parent, type) and issubclass(parent, BaseException) else Exception
                cls = type(name, (parent,), {"__module__": "program"})
            # One that exits, and StopIteration, which would silently end the test's map() or
            # filter() (`assert all(map(f, cases))` passing with no work; PEP 479's reason).
            usable = issubclass(cls, Exception) and not issubclass(cls, (StopIteration, StopAsyncIteration))
            self.exceptions[name] = cls if usable else None
        return self.exceptions[name]

    # -- a call, from a test's thread ------------------------------------------------------------
    def _refuse(self, test, why: str):
        if test is not None and not test.refused:
            test.refused = why[:MAX_DETAIL]
        raise Refused(why)

    def _call(self, name: str, args: tuple, kwargs: dict):
        test = self.current
        try:
            enc = Encoder(self.budget, self.refs)
            request = {"fn": name, "args": [enc.encode(a) for a in args],
                       "kwargs": [[k, enc.encode(v)] for k, v in kwargs.items()]}
        except NotPlain as e:
            self._refuse(test, f"{name}(): argument refused, only plain data is passed to the program: {e}")
        with self._lock:
            self._replied.clear()
            self._request = request
            self._wake.set()
            self._replied.wait()
            reply, self._reply = self._reply, None
        if "refused" in reply:
            self._refuse(test, reply["refused"])
        try:
            return self._answer(test, name, args, kwargs, reply)
        except NotPlain as e:
            self._refuse(test, f"{name}(): {e}")

    def _answer(self, test, name: str, args: tuple, kwargs: dict, reply: dict):
        """What a call gives the test: its output written, its arguments updated, then its value
        returned or its exception raised."""
        if reply.get("out"):
            sys.stdout.write(reply["out"])
        for old, new in zip(args, reply["args"]):
            self._update(old, new)
        for (_, old), (_, new) in zip(kwargs.items(), reply["kwargs"]):
            self._update(old, new)
        if "raise" not in reply:
            return decode(reply["value"])
        type_name, base, message = reply["raise"]
        cls = self._exception_class(type_name, base)
        if cls is None:
            self._refuse(test, f"{name}() raised {type_name}: a function that exits or raises StopIteration "
                               f"passes no test")
        raise cls(message)

    @staticmethod
    def _update(old, new) -> None:
        if new is not None and type(old) in MUTABLE:
            update_in_place(old, decode(new))

    # -- the tests, from the supervisor's cells --------------------------------------------------
    def _run(self, test: _Test, code) -> None:
        try:
            exec(code, self.ns)
            test.passed = not test.refused
            test.detail = test.refused
        except BaseException as e:  # noqa: BLE001 - any exception fails the test
            test.detail = test.refused or _describe(e)
        test.finished = True
        self._wake.set()

    def _start(self, test: _Test) -> None:
        try:
            code = compile(self.tests[test.index], f"<test {test.index + 1}>", "exec")
        except (SyntaxError, ValueError) as e:
            test.finished, test.detail = True, _describe(e)
            return
        threading.Thread(target=self._run, args=(test, code), daemon=True).start()

    def step(self, reply, a_wall_s: float) -> None:
        t0 = time.monotonic()
        cell_end, results, state = t0 + CELL_SHARE * self.wall_s, [], None
        if reply is not None:
            self.current.spent += max(0.0, float(a_wall_s))
            self._request, self._reply = None, json.loads(base64.b64decode(reply))
            self._replied.set()
        while state is None:
            if self.current is None:
                if self.next >= len(self.tests):
                    state = "done"
                    break
                if time.monotonic() >= cell_end or len(dumps(results)) >= self.results_cap:
                    state = "yield"
                    break
                self.current, self.next = _Test(self.next), self.next + 1
                self._start(self.current)  # current first: the test's calls read it
            test, began = self.current, time.monotonic()
            fired = test.finished or self._wake.wait(max(0.0, min(self.wall_s - test.spent, cell_end - began)))
            test.spent += time.monotonic() - began
            if fired:
                self._wake.clear()
                if test.finished:
                    results.append([test.index, test.passed, test.detail[:self.detail_cap]])
                    self.current = None
                elif self._request is not None:
                    state = "call"
            elif test.spent >= self.wall_s:
                state = "timeout"
            else:
                state = "yield"
        self._emit({"state": state, "results": results, "call": self._request if state == "call" else None})

    def _emit(self, event) -> None:
        data = (self.nonce + dumps(event) + "\n").encode("ascii")
        while data:
            data = data[os.write(1, data):]


def _describe(exc) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"[:MAX_DETAIL]
    except Exception:  # noqa: BLE001
        return type(exc).__name__
