"""Grading a program by its tests so that no code of the program's can reach the verdict.

  supervisor (this module)                      A: the program's sandbox
    1. the program ─────────────────────────────► launcher runs it, then callee.py
       ◄─ its top-level names (plain data) ──────  names its functions, values, modules
                                                   B: the tests' sandbox, a fresh interpreter
    2. the tests + stand-ins for the names ─────► harness.py (never runs the program's code)
    3. ◄─ "call f(plain args)" / verdicts ───────  runs each test with its own builtins
       ─ relay the call ─────────────────────────► A calls f, answers plain data only
       ◄─ A's answer, checked by plain.check
       ─ the checked answer ─────────────────────► B goes on, decides each test's verdict

Why the verdict is out of the program's reach: the tests run, and their pass or fail is decided,
in B, a separate process in its own bubblewrap sandbox that runs only the launcher, harness.py and
the tests. Nothing of A reaches B but data this process has checked to be plain (plain.py: exact
built-in types, bounded), rebuilt in B by B's own decoder: no object of the program's, so no
`__eq__`, `__bool__` or subclass of it, and no access to B's builtins, modules, frames, stdout or
control pipe. B reports verdicts after a nonce A never sees. A can only answer each call with some
plain value, which is what an honest function does; the tests judge that value. The program never
sees the tests either (only the arguments of its calls).

What a test's time is: B's own time on it plus the wall time of the calls it made in A; past
`limits.wall_s` it is a timeout. The relay between them and waits for a free sandbox slot
(pool.MAX_RUNNING) are not counted, so a burst of gradings does not time honest tests out; a test
that calls without end is still stopped (its calls' own time adds up; about 3x wall_s of real
time under load in tests/test_code_grading.py). A call is also cut at `wall_s` by A's sandbox, as is each cell of
B's. A timeout, a sandbox limit or a crash of either interpreter fails the test it happened in and
every test after it, with the reason counted as before (timeout, violation, crash).

Each grading takes two sandboxes from the pools (sandbox/pool.py), A and B, and destroys both. The
pools keep them primed (PRIME_A, PRIME_B: callee.py or harness.py already compiled in, before any
program ran there) and B is handed the tests while A loads the program, so the second sandbox adds
little to a grading's latency when the pools are full; its cost is CPU, one more sandbox started
per grading (BENCHMARKS.md, "Grading code in two sandboxes").
"""

from __future__ import annotations

import asyncio
import base64
import json
import keyword
import secrets
from pathlib import Path
from typing import Sequence

from lockstep.sandbox.callee import MAX_NAMES
from lockstep.sandbox.plain import FRAME, NotPlain, check, dumps
from lockstep.sandbox.pool import Session
from lockstep.sandbox.types import Graded, Limits, SandboxError, Verdict

_HERE = Path(__file__).parent
_PLAIN = (_HERE / "plain.py").read_text()
_CALLEE = (_HERE / "callee.py").read_text()
_HARNESS = (_HERE / "harness.py").read_text()

MAX_VALUE_BYTES = 128 << 10
"""Most JSON bytes of plain data that cross in one call (arguments, or result and arguments after),
or in the program's top-level names and values; at most half of `limits.output_kb` (both sandboxes
answer on their stdout, which that caps). Past it the call fails its test, saying so."""
MAX_OUT_CHARS = 16 << 10
"""Most characters of a call's own output forwarded to the test (print-checking tests)."""
TESTS_CHUNK = 256 << 10
"""Tests are handed to B in cells of at most this many bytes (a cell is at most 1 MiB)."""
_KINDS = {"fn": 1, "exc": 2, "mod": 2, "val": 2}


def _install(module: str, source: str) -> str:
    """A cell that runs `source` as module `module` (not in the cell's namespace)."""
    blob = base64.b64encode(source.encode()).decode()
    return (f"__import__('sys').modules[{module!r}] = __import__('types').ModuleType({module!r})\n"
            f"exec(__import__('base64').b64decode({blob!r}).decode(), __import__('sys').modules[{module!r}].__dict__)")


PRIME_A = _install("_lockstep_callee", _PLAIN + "\n" + _CALLEE)
PRIME_B = _install("_lockstep_harness", _PLAIN + "\n" + _HARNESS)
"""Cells that pooled sandboxes run before they are handed out (sandbox/pool.py's `prime`): the
callee or the harness compiled in a sandbox that has run nothing else, off a grading's latency."""


def value_budget(limits: Limits) -> int:
    return max(128, min(MAX_VALUE_BYTES, (limits.output_kb << 10) // 2 - 256))


def _b64(obj) -> str:
    return base64.b64encode(dumps(obj).encode()).decode()


def _hard(verdict: Verdict) -> str:
    return {"timeout": "timeout", "limit": "violation"}.get(verdict.status, "crash")


def _frame(stdout: str, marker: str, budget: int):
    """(the JSON object after the last `marker` on a sandbox's stdout, what came before) or None."""
    head, found, tail = stdout.rpartition(marker)
    if not found or len(tail) > budget + (64 << 10):
        return None
    try:
        obj = json.loads(tail)
    except (ValueError, RecursionError):
        return None
    return (obj, head) if isinstance(obj, dict) else None


def _ident(name) -> bool:
    return type(name) is str and len(name) <= 100 and name.isidentifier() and not keyword.iskeyword(name)


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _names(answer) -> list | None:
    """The program's names from A's manifest frame; entries that are not well formed are dropped."""
    if answer is None or type(answer[0].get("names")) is not list:
        return None
    out = []
    for item in answer[0]["names"][:MAX_NAMES]:
        if type(item) is not list or len(item) != 2 or not _ident(item[0]) or type(item[1]) is not list:
            continue
        if _dunder(item[0]):  # __builtins__ and the like are the tests' namespace's own
            continue
        name, entry = item
        if not entry or entry[0] not in _KINDS or len(entry) != _KINDS[entry[0]]:
            continue
        kind = entry[0]
        try:
            if kind == "val":
                check(entry[1])
            elif kind != "fn" and not (type(entry[1]) is str and all(_ident(p) for p in entry[1].split("."))):
                continue
        except NotPlain:
            continue
        out.append([name, entry])
    return out


class _Run:
    """One grading: the two sessions and the tests' results so far."""

    def __init__(self, program: str, tests: Sequence[str], limits: Limits, entry_point: str):
        self.program, self.tests, self.limits, self.entry_point = program, list(tests), limits, entry_point
        self.a, self.b = Session(limits, PRIME_A), Session(limits, PRIME_B)
        self.budget, self.nonce = value_budget(limits), secrets.token_hex(16)
        self.passed = [False] * len(self.tests)
        self.details = [""] * len(self.tests)
        self.functions: set[str] = set()
        self.names = ""

    def result(self, reason: str = "") -> Graded:
        if not reason:
            reason = "ok" if all(self.passed) else "failed"
        return Graded(tuple(self.passed), reason, tuple(self.details))

    def fail_rest(self, reason: str, why: str) -> Graded:
        for i, (ok, detail) in enumerate(zip(self.passed, self.details)):
            if not ok and not detail:
                self.details[i] = why[:300]
        return self.result(reason)

    async def load(self) -> Graded | None:
        """Run the program in A while B is set up, then bind its names in B (a Graded when grading
        ends here). The first step of B goes with the names (see run)."""
        named, set_up = await asyncio.gather(self._load_program(), self._set_up_tests(), return_exceptions=True)
        for outcome in (set_up, named):
            if isinstance(outcome, BaseException):
                raise outcome
        verdict = named
        names = _names(_frame(verdict.stdout, FRAME, self.budget)) if verdict.ok else None
        if names is None:
            why = f"{verdict.reason} {verdict.error}" if not verdict.ok else "it did not name its functions"
            return self.fail_rest(_hard(verdict), f"the program failed: {why}")
        self.functions = {n for n, e in names if e[0] == "fn"}
        if self.entry_point and self.entry_point not in self.functions:
            return self.fail_rest("missing_entry_point", f"the program defines no function {self.entry_point}")
        self.names = _b64(names)
        return None

    async def _load_program(self) -> Verdict:
        """One cell of A: the callee, then the program (callee.load), then its names on stdout."""
        program = base64.b64encode(self.program.encode("utf-8", "replace")).decode()
        return await self.a.cell(f"__import__('sys').modules['_lockstep_callee'].load(globals(), "
                                 f"{program!r}, {self.budget}, {self.entry_point!r})")

    async def _set_up_tests(self) -> None:
        setup = {"nonce": self.nonce, "wall_s": self.limits.wall_s, "budget": self.budget,
                 "entry_point": self.entry_point, "out_cap": self.limits.output_kb << 10}
        cells = [f"H = __import__('sys').modules['_lockstep_harness'].Harness({_b64(setup)!r})"]
        size = 0
        for test in self.tests:  # in the first cell while they fit, then in cells of TESTS_CHUNK
            if size and size + len(test) > TESTS_CHUNK:
                cells.append("")
                size = 0
            cells[-1] += f"\nH.add_tests({_b64([test])!r})"
            size += len(test)
        for cell in cells:
            verdict = await self.b.cell(cell)
            if not verdict.ok:  # our own code, before any test ran: the sandbox is at fault, not the program
                raise SandboxError(f"the tests' sandbox could not be set up: {verdict.reason} {verdict.error}")

    async def relay(self, call: dict) -> tuple[str | None, float, str]:
        """A's answer to one call, checked, as B's reply: (reply, A's wall seconds, hard reason)."""
        request = _b64({**call, "budget": self.budget})
        verdict = await self.a.cell(f"__import__('sys').modules['_lockstep_callee'].call(globals(), {request!r})")
        if verdict.status in ("timeout", "limit") or not self.a.started:
            return None, verdict.wall_s, _hard(verdict)
        answer = _frame(verdict.stdout, FRAME, self.budget) if verdict.ok else None
        reply = _reply(answer, call) if answer is not None else None
        if reply is None:
            reply = {"refused": f"the program gave no usable answer to a call of {call['fn']}"}
        reply["out"] = answer[1][-MAX_OUT_CHARS:] if answer is not None else ""
        return _b64(reply), verdict.wall_s, ""

    async def run(self) -> Graded:
        reply, a_wall, first = None, 0.0, f"H.bind({self.names!r})\n"
        while True:
            verdict = await self.b.cell(f"{first}H.step({reply!r}, {a_wall!r})")
            first = ""
            event = _frame(verdict.stdout, self.nonce, self.budget) if verdict.ok else None
            if event is None:
                return self.fail_rest(_hard(verdict), f"the tests' interpreter stopped: {verdict.reason}")
            event = event[0]
            if not self._record(event.get("results")):
                return self.fail_rest("crash", "malformed report from the tests' interpreter")
            state = event.get("state")
            if state == "done":
                return self.result()
            if state == "timeout":
                return self.fail_rest("timeout", f"a test ran past {self.limits.wall_s}s")
            reply, a_wall = None, 0.0
            if state == "call":
                call = self._call(event.get("call"))
                if call is None:
                    return self.fail_rest("crash", "malformed call from the tests' interpreter")
                reply, a_wall, hard = await self.relay(call)
                if hard:
                    return self.fail_rest(hard, f"the program's interpreter stopped during a call of {call['fn']}")
            elif state != "yield":
                return self.fail_rest("crash", "malformed report from the tests' interpreter")

    def _record(self, results) -> bool:
        if type(results) is not list:
            return False
        for item in results:
            if (type(item) is not list or len(item) != 3 or type(item[0]) is not int or type(item[1]) is not bool
                    or type(item[2]) is not str or not 0 <= item[0] < len(self.tests)):
                return False
            self.passed[item[0]], self.details[item[0]] = item[1], item[2][:300]
        return True

    def _call(self, call) -> dict | None:
        """B's call request, checked: a function of the program, plain arguments."""
        if type(call) is not dict or call.get("fn") not in self.functions:
            return None
        args, kwargs = call.get("args"), call.get("kwargs")
        if type(args) is not list or type(kwargs) is not list:
            return None
        try:
            for node in args:
                check(node, self.functions)
            for pair in kwargs:
                if type(pair) is not list or len(pair) != 2 or not _ident(pair[0]):
                    return None
                check(pair[1], self.functions)
        except NotPlain:
            return None
        return {"fn": call["fn"], "args": args, "kwargs": kwargs}

    def close(self) -> None:
        self.a.close()
        self.b.close()


def _reply(answer, call: dict) -> dict | None:
    """A's answer to `call`, checked to be plain data in the expected shape (None otherwise)."""
    obj = answer[0]
    try:
        if "refused" in obj:
            return {"refused": str(obj["refused"])[:300]} if type(obj["refused"]) is str else None
        args, kwargs = obj.get("args"), obj.get("kwargs")
        if (type(args) is not list or len(args) != len(call["args"]) or type(kwargs) is not list
                or len(kwargs) != len(call["kwargs"])):
            return None
        for node in args:
            if node is not None:
                check(node)
        for pair, sent in zip(kwargs, call["kwargs"]):
            if type(pair) is not list or len(pair) != 2 or pair[0] != sent[0]:
                return None
            if pair[1] is not None:
                check(pair[1])
        out = {"args": args, "kwargs": kwargs}
        if "value" in obj:
            check(obj["value"])
            return {**out, "value": obj["value"]}
        raised = obj.get("raise")
        if (type(raised) is list and len(raised) == 3 and _ident(raised[0]) and _ident(raised[1])
                and type(raised[2]) is str):
            return {**out, "raise": [raised[0], raised[1], raised[2][:500]]}
    except NotPlain:
        pass
    return None


async def grade(program: str, tests: Sequence[str], limits: Limits, *, entry_point: str = "") -> Graded:
    """Run `program` in one sandbox and `tests` against it from another (see the module docstring).
    `entry_point`, when given, must be a function the program defines (else missing_entry_point).
    Raises SandboxError only when the tests' sandbox cannot be set up (the machine's fault)."""
    run = _Run(program, tests, limits, entry_point)
    try:
        return await run.load() or await run.run()
    finally:
        run.close()
