"""The code env's judge before issue 27, kept only as the control of tests/hostile/grading/: each
attack there must win against it (and lose against envs/code.py's `run_tests`).

It ran the tests in the program's own interpreter, after the program, and judged only
`assert EXPR == LITERAL` (and `is None/True/False`, bare `assert EXPR`, `assert not EXPR`) outside,
on the repr of EXPR's value computed in that interpreter; every other test ran as written there.
Verbatim from src/lockstep/envs/code.py at d5a550f (split_assert, judged, run_test, run_tests, _hard).
Never used to grade anything.
"""

from __future__ import annotations

import ast
import asyncio
import secrets

from lockstep.envs.code import Outcome, Problem
from lockstep.sandbox.pool import run_program_blocking
from lockstep.sandbox.types import Limits

_LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


def split_assert(test: str) -> tuple[str, str, object] | None:
    """(expression, comparison, expected) of a test of the form `assert EXPR == LITERAL` (either
    side), `assert EXPR is None/True/False` or `assert EXPR` / `assert not EXPR`; None otherwise.

    Such a test is judged here, outside the sandbox: only the expression's value comes back (as
    its repr, read as a Python literal), so a program cannot pass it by forging the interpreter's
    answer, by exiting early, or with an object that equals everything."""
    try:
        body = ast.parse(test).body
    except _LITERAL_ERRORS:
        return None
    if len(body) != 1 or not isinstance(body[0], ast.Assert):
        return None
    t = body[0].test
    if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], (ast.Eq, ast.Is)):
        for expr, lit in ((t.left, t.comparators[0]), (t.comparators[0], t.left)):
            try:
                value = ast.literal_eval(lit)
            except _LITERAL_ERRORS:
                continue
            if isinstance(t.ops[0], ast.Is) and value not in (None, True, False):
                return None
            return ast.unparse(expr), "is" if isinstance(t.ops[0], ast.Is) else "==", value
        return None
    if isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
        return f"bool({ast.unparse(t.operand)})", "==", False
    return f"bool({ast.unparse(t)})", "==", True


def judged(verdict, marker: str, comparison: str, expected) -> bool:
    """Whether the value the sandbox printed after `marker` satisfies the comparison."""
    _, found, text = verdict.stdout.rpartition(marker)
    if not found:
        return False
    try:
        value = ast.literal_eval(text.rstrip("\n"))
    except _LITERAL_ERRORS:
        return False  # not a plain value: no custom __eq__ decides a test
    try:  # the assert's own semantics, on plain values
        return value is expected if comparison == "is" else bool(value == expected)
    except Exception:  # noqa: BLE001 - a comparison of literals that raises is a failed test
        return False


async def run_test(session, test: str):
    """(passed, the call's verdict) of one test in the program's interpreter."""
    split = split_assert(test)
    if split is None:  # a statement we cannot judge from outside: it runs as written
        verdict = await session.cell(test)
        return verdict.ok, verdict
    expr, comparison, expected = split
    marker = f"@@lockstep-{secrets.token_hex(8)}@@"
    verdict = await session.cell(f"print({marker!r} + repr(({expr})))")
    return verdict.ok and judged(verdict, marker, comparison, expected), verdict


async def run_tests_old(program: str, problem: Problem, limits: Limits) -> Outcome:
    """Run `program` then each test in one sandboxed interpreter."""
    from lockstep.sandbox.pool import Session

    total = len(problem.tests)
    session = Session(limits)
    try:
        verdict = await session.cell(program)
        if not verdict.ok:
            return Outcome(0, total, _hard(verdict))
        if problem.entry_point:
            check = await session.cell(f"assert callable({problem.entry_point})")
            if not check.ok:
                return Outcome(0, total, "missing_entry_point" if check.status == "error" else _hard(check))
        passed, reason = 0, "ok"
        for test in problem.tests:
            ok, verdict = await run_test(session, test)
            if ok:
                passed += 1
            elif verdict.status in ("ok", "error"):
                reason = "failed" if reason == "ok" else reason
            else:  # the interpreter was killed: the remaining tests cannot run
                return Outcome(passed, total, _hard(verdict))
        return Outcome(passed, total, reason)
    finally:
        session.close()


def _hard(verdict) -> str:
    return {"timeout": "timeout", "limit": "violation"}.get(verdict.status, "crash")


async def run_tests_naive(program: str, problem: Problem, limits: Limits) -> Outcome:
    """The simplest judge: the program and its tests as one script, every test passed when the script
    exits 0 (the control of attacks that the old judge already stopped, such as exiting early)."""
    verdict = await asyncio.get_running_loop().run_in_executor(
        None, run_program_blocking, program + "\n" + "\n".join(problem.tests) + "\n", limits)
    total = len(problem.tests)
    return Outcome(total if verdict.ok else 0, total, "ok" if verdict.ok else _hard(verdict))
