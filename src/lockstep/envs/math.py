"""`math`: problems with reference answers from a data file, graded by math-verify.

Rows are read from `env.path` (jsonl or parquet, `problem`/`question` and `answer`/`solution`).
The held-out set is `env.test_path`, or else the last `env.num_heldout` rows of `env.path`; either
way no held-out problem reaches a training batch. An episode is one turn: the prompt is
`env.prompt_template` with the problem in it (optionally wrapped in the tokenizer's chat template),
and the reward is 1 when math-verify finds the completion equal to the reference answer.

math-verify bounds its work with `signal.alarm`, which only works in a process's main thread, and
envs run inside Ray async actors off the main thread. So grading runs in a one-worker spawn
process pool per process (`grading_pool`), where `grade` runs on the worker's main thread and its
timeouts hold.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import lru_cache

from lockstep.envs.rows import read_rows
from lockstep.envs.text import SingleTurnEnv, TextSuite
from lockstep.envs.types import EnvError

PARSE_TIMEOUT_S = 3
"""math-verify's bound on parsing one answer (seconds, an int: it is a `signal.alarm`)."""
VERIFY_TIMEOUT_S = 3
"""math-verify's bound on one gold/prediction comparison; a grade makes at most a few, so a
pathological completion costs well under the env step deadline."""

FIELDS = (("problem", "question"), ("answer", "solution"))
"""Accepted column names of a math data file, first name wins."""


# ---------------------------------------------------------------- grading (runs in the pool's worker)


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> list:
    from math_verify import parse

    # A bare "0.5" or "\text{Monday}" only parses as LaTeX inside $...$ (math-verify's advice for
    # gold answers); a full solution with $ or \boxed is parsed as it is.
    if "$" not in answer and "\\boxed" not in answer:
        gold = parse(f"${answer}$", parsing_timeout=PARSE_TIMEOUT_S)
        if gold:
            return gold
    return parse(answer, parsing_timeout=PARSE_TIMEOUT_S)


def grade(gold_answer: str, completion: str) -> bool:
    """Whether `completion` states `gold_answer`, by math-verify. Must run on a main thread.

    Raises ValueError when the gold answer itself cannot be parsed: that problem cannot be graded,
    and scoring every sample 0 would hide it.
    """
    from math_verify import parse, verify

    gold = _parse_gold(gold_answer)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {gold_answer!r}")
    prediction = parse(completion, parsing_timeout=PARSE_TIMEOUT_S)
    return bool(verify(gold, prediction, timeout_seconds=VERIFY_TIMEOUT_S))


_POOL: ProcessPoolExecutor | None = None
_POOL_PID = 0
_POOL_LOCK = threading.Lock()


def grading_pool() -> ProcessPoolExecutor:
    """This process's grading pool (one spawned worker), created on first use; a forked child
    makes its own rather than sharing its parent's."""
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or _POOL_PID != os.getpid():
            _POOL = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            _POOL_PID = os.getpid()
        return _POOL


def _discard_pool(pool: ProcessPoolExecutor) -> None:
    global _POOL
    with _POOL_LOCK:
        if _POOL is pool:
            _POOL = None
    pool.shutdown(wait=False, cancel_futures=True)


async def grade_async(gold_answer: str, completion: str) -> bool:
    """`grade` in the grading pool; its exceptions propagate (the runtime retries the step)."""
    pool = grading_pool()
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, grade, gold_answer, completion)
    except BrokenProcessPool:
        # A dead worker (killed, out of memory) breaks the pool for good: drop it so that the
        # retry of this step gets a fresh one.
        _discard_pool(pool)
        raise


# ---------------------------------------------------------------- env, builders, suite


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    """The reference answer (or a full solution with a \\boxed answer)."""


class MathEnv(SingleTurnEnv):
    """One single-turn episode: reward 1 when math-verify finds the completion correct."""

    def __init__(self, prompt: tuple[int, ...], answer: str, tokenizer, *, max_tokens: int):
        super().__init__(prompt, tokenizer, max_tokens=max_tokens)
        self.answer = answer

    async def score(self, completion: str) -> tuple[float, bool]:
        correct = await grade_async(self.answer, completion)
        return (1.0 if correct else 0.0), correct


@dataclass(frozen=True)
class MathGroupBuilder:
    group_id: str
    question: str
    answer: str
    prompt: tuple[int, ...]
    """The rendered prompt tokens (template and chat template already applied)."""
    max_tokens: int

    def make_envs(self, group_size: int, tokenizer) -> list[MathEnv]:
        return [MathEnv(self.prompt, self.answer, tokenizer, max_tokens=self.max_tokens) for _ in range(group_size)]


class MathSuite(TextSuite):
    name = "math"
    group_prefix = "math"

    def __init__(self, tokenizer, *, path: str, test_path: str = "", num_heldout: int, seed: int,
                 prompt_template: str, chat_template: bool, max_tokens: int):
        super().__init__(tokenizer, seed=seed, prompt_template=prompt_template, chat_template=chat_template,
                         max_tokens=max_tokens)
        rows = self._read(path)
        if test_path:
            heldout = self._read(test_path)
        elif len(rows) <= num_heldout:
            raise EnvError(f"{path}: {len(rows)} usable rows, but env.num_heldout = {num_heldout} are held out "
                           f"from its end, which leaves none to train on; lower env.num_heldout or give the "
                           f"held-out rows in env.test_path")
        else:
            rows, heldout = rows[:-num_heldout], rows[-num_heldout:]
        self.heldout_problems = [Problem(str(r["problem"]), str(r["answer"])) for r in heldout]
        held = {p.question for p in self.heldout_problems}
        train = [Problem(str(r["problem"]), str(r["answer"])) for r in rows]
        self.problems = [p for p in train if p.question not in held]
        if len(self.problems) < len(train):
            warnings.warn(f"{path}: {len(train) - len(self.problems)} training rows repeat a held-out problem; "
                          f"they are left out of training", stacklevel=2)
        if not self.problems:
            raise EnvError(f"{path}: every training problem is also held out ({test_path or 'the end of path'})")

    def _read(self, path: str) -> list[dict]:
        rows, self._reports[path] = read_rows(path, FIELDS)
        return rows

    def builder(self, group_id: str, problem: Problem) -> MathGroupBuilder:
        return MathGroupBuilder(group_id, problem.question, problem.answer, self.render(problem.question),
                                self.max_tokens)

    @property
    def num_train(self) -> int:
        return len(self.problems)

    def train_builder(self, group_id: str, k: int) -> MathGroupBuilder:
        return self.builder(group_id, self.problems[k])

    def solved(self, k: int) -> tuple[str, str]:
        return self.problems[k].question, self.problems[k].answer

    def heldout(self) -> list[MathGroupBuilder]:
        return [self.builder(f"heldout-{k}", p) for k, p in enumerate(self.heldout_problems)]


def make_suite(spec, tokenizer, seed: int) -> MathSuite:
    return MathSuite(tokenizer, path=spec.path, test_path=spec.test_path, num_heldout=spec.num_heldout, seed=seed,
                     prompt_template=spec.prompt_template, chat_template=spec.chat_template,
                     max_tokens=spec.max_tokens)
