"""`code`: the model writes a Python function; the reward is the share of the problem's tests that
its program passes, run in the sandbox (lockstep/sandbox).

A problem is a row of `prompt` (the task), `tests` (a list of Python statements, usually asserts,
run after the program in its namespace, one by one) and optionally `entry_point` (the function the
tests call; a program that does not define it passes nothing) and `solution` (a reference program,
for warm-up). MBPP's `text` / `test_list` / `code` names are accepted too. The shipped file
(envs/data/code_problems.jsonl, 48 problems written for this project) is the default data.

The completion is parsed as code: the body of the first fenced block (```python ... ```), or, when
the prompt itself opened a fence (the default template ends with one), everything up to the
closing fence; text without a fence is taken as plain code. Every test runs in the same
interpreter after the program; one that times out or hits a limit kills the interpreter, and the
tests after it fail. Timeouts, crashes (exceptions, nonzero exits, signals) and sandbox violations
(limits hit) are counted separately in the step's metrics.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from lockstep.envs.rows import read_rows
from lockstep.envs.text import SingleTurnEnv, TextSuite, require_sandbox, split_heldout
from lockstep.envs.types import EnvError
from lockstep.sandbox.types import Limits

SHIPPED = Path(__file__).parent / "data" / "code_problems.jsonl"
DEFAULT_TEMPLATE = "{question}\n```python\n"
"""Opens the fence, so that the completion is the program and its closing fence."""
FIELDS = (("prompt", "text"), ("tests", "test_list"))
MAX_TESTS = 100
MAX_TEST_CHARS = 10_000

_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.S)


def parse_code(completion: str, *, fence_open: bool) -> str:
    """The program in a completion (see the module docstring)."""
    if fence_open:
        return completion.split("```", 1)[0]
    block = _FENCE.search(completion)
    return block.group(1) if block else completion


def check_tests(row: dict) -> str:
    """Why a row's `tests` cannot be used ('' when they can). A JSON string holding a list is
    accepted (parquet exports of MBPP store it so)."""
    tests = row["tests"]
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError:
            tests = [tests]
    if not isinstance(tests, (list, tuple)) or not tests:
        return "malformed field 'tests' (expected a non-empty list of Python statements)"
    if len(tests) > MAX_TESTS or not all(isinstance(t, str) and t.strip() and len(t) <= MAX_TEST_CHARS for t in tests):
        return (f"malformed field 'tests' (expected at most {MAX_TESTS} non-empty strings of at most "
                f"{MAX_TEST_CHARS} characters)")
    for i, test in enumerate(tests, start=1):
        try:
            compile(test, "<test>", "exec")  # parsed, never run here
        except (SyntaxError, ValueError) as e:
            return f"malformed field 'tests' (test {i} is not valid Python: {e.msg if isinstance(e, SyntaxError) else e})"
    entry = row.get("entry_point")
    if entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
        return "malformed field 'entry_point' (expected a Python identifier)"
    row["tests"] = tuple(tests)
    return ""


@dataclass(frozen=True)
class Problem:
    prompt: str
    tests: tuple[str, ...]
    entry_point: str = ""
    solution: str = ""


@dataclass(frozen=True)
class Outcome:
    """What running a program against a problem's tests gave."""

    passed: int
    total: int
    reason: str
    """ok (every test passed), failed (some test failed), or the first hard failure: timeout, crash,
    violation (a sandbox limit), missing_entry_point."""


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


async def run_tests(program: str, problem: Problem, limits: Limits) -> Outcome:
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


class CodeEnv(SingleTurnEnv):
    """One single-turn episode: the program is graded by the problem's tests, in the sandbox."""

    def __init__(self, prompt: tuple[int, ...], problem: Problem, tokenizer, *, max_tokens: int, limits: Limits,
                 all_or_nothing: bool, fence_open: bool):
        super().__init__(prompt, tokenizer, max_tokens=max_tokens)
        self.problem, self.limits = problem, limits
        self.all_or_nothing, self.fence_open = all_or_nothing, fence_open

    async def step(self, action: Sequence[int]):
        from lockstep.envs.types import StepResult

        completion = self.tokenizer.decode(list(action), skip_special_tokens=True)
        out = await run_tests(parse_code(completion, fence_open=self.fence_open), self.problem, self.limits)
        share = out.passed / out.total
        reward = float(out.passed == out.total) if self.all_or_nothing else share
        metrics = {"correct": float(out.passed == out.total), "tests_passed": share,
                   **{f"code_{r}": float(out.reason == r) for r in ("timeout", "crash", "violation")}}
        return StepResult(reward, True, metrics=metrics)


@dataclass(frozen=True)
class CodeGroupBuilder:
    group_id: str
    problem: Problem
    prompt: tuple[int, ...]
    max_tokens: int
    limits: Limits
    all_or_nothing: bool
    fence_open: bool

    def make_envs(self, group_size: int, tokenizer) -> list[CodeEnv]:
        return [CodeEnv(self.prompt, self.problem, tokenizer, max_tokens=self.max_tokens, limits=self.limits,
                        all_or_nothing=self.all_or_nothing, fence_open=self.fence_open) for _ in range(group_size)]


class CodeSuite(TextSuite):
    name = "code"
    group_prefix = "code"

    def __init__(self, tokenizer, *, path: str, test_path: str, num_heldout: int, seed: int, prompt_template: str,
                 chat_template: bool, max_tokens: int, limits: Limits, all_or_nothing: bool):
        require_sandbox("code")
        super().__init__(tokenizer, seed=seed, prompt_template=prompt_template, chat_template=chat_template,
                         max_tokens=max_tokens)
        self.limits, self.all_or_nothing = limits, all_or_nothing
        self.fence_open = prompt_template.rstrip(" ").endswith(("```\n", "```python\n", "```py\n"))
        rows, heldout = split_heldout(self._read(path or str(SHIPPED)), self._read(test_path) if test_path else None,
                                      num_heldout)
        self.problems = [self._problem(r) for r in rows]
        self.heldout_problems = [self._problem(r) for r in heldout]
        if not self.problems:
            raise EnvError(f"{path or SHIPPED}: no training problems left after holding out {len(heldout)}")
        longest = max((len(tokenizer.encode(p.solution)) for p in self.problems if p.solution), default=0)
        self.max_tokens = max(max_tokens, longest + 8)

    def _read(self, path: str) -> list[dict]:
        rows, self._reports[path] = read_rows(path, FIELDS, optional=("entry_point", "solution", "code"),
                                              check=check_tests)
        return rows

    @staticmethod
    def _problem(row: dict) -> Problem:
        return Problem(str(row["prompt"]), tuple(row["tests"]), str(row.get("entry_point") or ""),
                       str(row.get("solution") or row.get("code") or ""))

    def builder(self, group_id: str, p: Problem) -> CodeGroupBuilder:
        return CodeGroupBuilder(group_id, p, self.render(p.prompt), self.max_tokens, self.limits,
                                self.all_or_nothing, self.fence_open)

    @property
    def num_train(self) -> int:
        return len(self.problems)

    def train_builder(self, group_id: str, k: int) -> CodeGroupBuilder:
        return self.builder(group_id, self.problems[k])

    def solved(self, k: int) -> tuple[str, str]:
        p = self.problems[k]
        return p.prompt, p.solution + ("```" if self.fence_open else "")

    def check_solvable(self) -> None:
        if not all(p.solution for p in self.problems):
            raise EnvError("an sft stage on the code env needs a `solution` in every training row (or a data file "
                           "of prompt and completion rows in the stage's `dataset`)")

    def heldout(self) -> list[CodeGroupBuilder]:
        return [self.builder(f"heldout-{k}", p) for k, p in enumerate(self.heldout_problems)]


def make_suite(spec, tokenizer, seed: int) -> CodeSuite:
    template = DEFAULT_TEMPLATE if spec.prompt_template == "{question}\nAnswer: " else spec.prompt_template
    return CodeSuite(tokenizer, path=spec.path, test_path=spec.test_path, num_heldout=spec.num_heldout, seed=seed,
                     prompt_template=template, chat_template=spec.chat_template, max_tokens=spec.max_tokens,
                     limits=spec.sandbox, all_or_nothing=spec.reward == "all")
