"""`code`: the model writes a Python function; the reward is the share of the problem's tests that
its program passes, run in the sandbox (lockstep/sandbox).

A problem is a row of `prompt` (the task), `tests` (a list of Python statements, usually asserts,
run after the program in its namespace, one by one) and optionally `entry_point` (the function the
tests call; a program that does not define it passes nothing) and `solution` (a reference program,
for warm-up). MBPP's `text` / `test_list` / `code` names are accepted too. The shipped file
(envs/data/code_problems.jsonl, 48 problems written for this project) is the default data.

The completion is parsed as code: the body of the first fenced block (```python ... ```), or, when
the prompt itself opened a fence (the default template ends with one), everything up to the
closing fence; text without a fence is taken as plain code.

Grading (sandbox/grading.py): the program runs in one sandbox; the tests run, one after another in
one namespace, in a second sandbox that never runs the program's code, and each test's pass or
fail is decided there (a test passes when it raises nothing), so nothing the program does (its
own `bool`, objects that equal everything, a patched launcher, a forged answer, reading the
tests) can make a test pass. What the tests see of the program's top-level names:
  - functions (and other callables) as proxies: a call sends its arguments to the program as
    plain data and returns the result as plain data: None, bool, int, float, complex, str, bytes,
    bytearray, and tuples, lists, dicts, sets, frozensets and ranges of those (exact types, no
    subclasses); a built-in iterator or generator comes back as a list iterator of its items. A
    list, dict, set or bytearray argument is updated in place to its value after the call; what
    the call printed is written to the tests' stdout (so `contextlib.redirect_stdout` checks
    work); an exception it raised is raised in the test as the built-in class of that name (or a
    plain class named after it, deriving from its nearest built-in base), so `try/except` tests work;
  - plain values as copies; imported standard-library modules as the tests' own imports of them
    (under their own name only: not `import cmath as math`); exception classes as plain classes of
    the same name;
  - names that would hide a builtin are not bound (the problem's entry point excepted); the
    program's own functions can be passed to its functions (they travel by name).
So every form of test works: `assert f(x) == y`, bare `assert f(x)`, `<`, `!=`, `is`,
`math.isclose(f(x), y)`, `set(f(x)) == set(...)`, loops, multi-line statements, helper definitions.
Forms that fail (never pass): a result or argument that is not plain data (an instance of the
program's class, a lambda passed to the program), calling methods of the program's objects, names
the program defines that are neither callables, plain values nor standard-library modules, and a
function that exits (SystemExit), raises StopIteration (which would silently end a test's map()),
or returns more than grading.MAX_VALUE_BYTES of data. Identity is
not kept (values are copies), and a test changing a copied top-level value does not change the
program's. A test's time is its own plus its calls' (at most `wall_s`); a timeout or limit in
either sandbox, or the program's interpreter dying, fails that test and the ones after it.
Timeouts, crashes (exceptions, nonzero exits, signals) and sandbox violations (limits hit) are
counted separately in the step's metrics.
"""

from __future__ import annotations

import json
import re
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


async def run_tests(program: str, problem: Problem, limits: Limits) -> Outcome:
    """Grade `program` by the problem's tests: the program runs in one sandbox, the tests in another
    that never runs the program's code (sandbox/grading.py; the forms supported are in the module
    docstring)."""
    from lockstep.sandbox.grading import grade

    graded = await grade(program, problem.tests, limits, entry_point=problem.entry_point)
    return Outcome(sum(graded.passed), len(problem.tests), graded.reason)


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
