"""`python_tool`: multi-turn tool use. The model may run Python in the episode's own sandboxed
interpreter (its state kept across turns) before it answers.

A turn is the model's text up to a stop: `<python>code</python>` runs the code and the env appends
its output as the next observation (`<output>...</output>`, env-inserted tokens, never trained
on); `<answer>value</answer>` ends the episode and is graded; anything else ends it unanswered.
The episode also ends, unanswered, after `env.max_turns` turns (at least 2; the default 1 means 4).

Problems: rows of `problem` and `answer` from `env.path` (graded by math-verify; an optional `code`
field, Python that prints the answer, makes the row's warm-up transcript a tool call), or by default
procedural arithmetic that is worth computing (products, sums and remainders of `env.digits`-digit
numbers, graded exactly).

Between turns the interpreter is stopped (`Session(pause_idle=True)`: its cgroup v2 frozen, or its
processes SIGSTOPped), so nothing a cell left behind runs while the model writes.

Snapshots are the episode's text and the cells that ran; `restore()` replays those cells into a
fresh interpreter before the next one runs (measured cheaper and simpler than forking a paused
interpreter, see BENCHMARKS.md: a replay costs the cells' own run time, and a snapshot is a few
strings that pickle across processes). The interpreter seeds `random` and the string hash the
same way every time, so a replay of deterministic code rebuilds the same state; code that reads
the clock or the pid may differ on replay (`tool_replay_mismatch` counts cells whose verdict
changed).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Sequence

from lockstep.envs.rows import read_rows
from lockstep.envs.text import TextSuite, require_sandbox, split_heldout
from lockstep.envs.types import EnvError, EnvSnapshot, Observation, StepResult, restore_state
from lockstep.sandbox.types import Limits

DEFAULT_TEMPLATE = ("{question}\nRun Python as <python>code</python>; reply <answer>value</answer>.\n")
STOPS = ("</python>", "</answer>")
OUTPUT_CHARS = 400
"""Tool output shown to the model per call (the head and the tail when longer)."""
MAX_CONTEXT = 4096
"""An episode whose context grows past this many tokens ends unanswered."""
DEFAULT_TURNS = 4

_CODE = re.compile(r"<python>(.*?)(?:</python>|\Z)", re.S)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|\Z)", re.S)


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    exact: bool = True
    """True: the answer must equal `answer` after stripping; False: graded by math-verify."""
    code: str = ""
    """A reference tool call that prints the answer (warm-up transcripts); optional in data rows."""


def procedural(rng: random.Random, digits: int) -> Problem:
    """A product, a sum or a remainder of `digits`-digit numbers (the remainder's dividend has twice
    as many)."""
    lo, hi = 10 ** (digits - 1), 10**digits
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(lo, hi), rng.randrange(lo, hi)
        return Problem(f"What is {a} * {b}?", str(a * b))
    if kind == 1:
        xs = [rng.randrange(lo, hi) for _ in range(rng.randrange(3, 6))]
        return Problem(f"What is the sum of {', '.join(map(str, xs))}?", str(sum(xs)))
    a, b = rng.randrange(lo * lo, hi * hi), rng.randrange(max(lo, 2), hi)
    return Problem(f"What is {a} mod {b}?", str(a % b))


def shown(text: str) -> str:
    if len(text) <= OUTPUT_CHARS:
        return text
    half = OUTPUT_CHARS // 2
    return f"{text[:half]}\n...[{len(text) - OUTPUT_CHARS} characters left out]...\n{text[-half:]}"


class PythonToolEnv:
    """One episode: tool calls into one sandboxed interpreter, then an answer."""

    def __init__(self, prompt: tuple[int, ...], problem: Problem, tokenizer, *, max_tokens: int, max_turns: int,
                 limits: Limits):
        self.prompt, self.problem, self.tokenizer = prompt, problem, tokenizer
        self.max_tokens, self.max_turns, self.limits = max_tokens, max_turns, limits
        self.context, self.turn = tuple(prompt), 0
        self.cells: list[tuple[str, str]] = []
        """(code, verdict status) of every cell whose effects the interpreter holds."""
        self.calls = self.errors = self.mismatches = 0
        self._session = None
        self._replay = False

    # -- the contract ---------------------------------------------------------------------------
    async def initial_observation(self) -> Observation:
        return Observation(self.context, STOPS, self.max_tokens)

    async def step(self, action: Sequence[int]) -> StepResult:
        self.turn += 1
        text = self.tokenizer.decode(list(action), skip_special_tokens=True)
        answer, code = _ANSWER.search(text), _CODE.search(text)
        if answer and (not code or answer.start() < code.start()):
            return self._done(await self._grade(answer.group(1).strip()))
        if not code or self.turn >= self.max_turns:
            return self._done(False)
        output = await self._run(code.group(1))
        inserted = tuple(self.tokenizer.encode(f"\n<output>\n{shown(output)}</output>\n"))
        self.context = self.context + tuple(action) + inserted
        if len(self.context) + self.max_tokens > MAX_CONTEXT:
            return self._done(False)
        return StepResult(0.0, False, Observation(self.context, STOPS, self.max_tokens), metrics=self._metrics(False))

    def snapshot(self) -> EnvSnapshot:
        return EnvSnapshot.of(self, {"context": self.context, "turn": self.turn, "cells": tuple(self.cells),
                                     "calls": self.calls, "errors": self.errors})

    def restore(self, snapshot: EnvSnapshot) -> None:
        state = restore_state(self, snapshot)
        self.close()
        self.context, self.turn, self.cells = tuple(state["context"]), state["turn"], list(state["cells"])
        self.calls, self.errors = state["calls"], state["errors"]
        self._replay = bool(self.cells)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    # -- the interpreter ------------------------------------------------------------------------
    async def _run(self, code: str) -> str:
        from lockstep.sandbox.pool import Session

        if self._session is None:  # stopped between turns: nothing of it runs while the model writes
            self._session = Session(self.limits, pause_idle=True)
        if self._replay:
            await self._replay_cells()
        self.calls += 1
        verdict = await self._session.cell(code)
        if self._session.started:  # its effects live on in the interpreter
            self.cells.append((code, verdict.status))
        elif self.cells:  # killed (timeout, limit): the next cell gets a fresh interpreter, replayed
            self._replay = True
        out = verdict.stdout + verdict.stderr
        if not verdict.ok:
            self.errors += 1
            if verdict.status in ("timeout", "limit"):
                out += f"[stopped: {verdict.reason}]\n"
        return out

    async def _replay_cells(self) -> None:
        self._replay = False
        for code, status in self.cells:
            verdict = await self._session.cell(code)
            self.mismatches += verdict.status != status

    # -- grading --------------------------------------------------------------------------------
    async def _grade(self, answer: str) -> bool:
        if self.problem.exact:
            return answer == self.problem.answer
        from lockstep.envs.math import grade_async

        return await grade_async(self.problem.answer, answer)

    def _metrics(self, correct: bool) -> dict[str, float]:
        return {"correct": float(correct), "tool_calls": float(self.calls), "tool_errors": float(self.errors),
                "tool_replay_mismatch": float(self.mismatches)}

    def _done(self, correct: bool) -> StepResult:
        self.close()
        return StepResult(1.0 if correct else 0.0, True, metrics=self._metrics(correct))

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


@dataclass(frozen=True)
class ToolGroupBuilder:
    group_id: str
    problem: Problem
    prompt: tuple[int, ...]
    max_tokens: int
    max_turns: int
    limits: Limits

    def make_envs(self, group_size: int, tokenizer) -> list[PythonToolEnv]:
        return [PythonToolEnv(self.prompt, self.problem, tokenizer, max_tokens=self.max_tokens,
                              max_turns=self.max_turns, limits=self.limits) for _ in range(group_size)]


class PythonToolSuite(TextSuite):
    name = "python_tool"
    group_prefix = "tool"

    def __init__(self, tokenizer, *, path: str, test_path: str, num_heldout: int, size: int, seed: int, digits: int,
                 prompt_template: str, chat_template: bool, max_tokens: int, max_turns: int, limits: Limits):
        require_sandbox("python_tool")
        super().__init__(tokenizer, seed=seed, prompt_template=prompt_template, chat_template=chat_template,
                         max_tokens=max(max_tokens, 64))
        self.limits, self.max_turns = limits, max_turns if max_turns > 1 else DEFAULT_TURNS
        if path:
            self.problems, self.heldout_problems = split_heldout(
                self._rows(path), self._rows(test_path) if test_path else None, num_heldout)
        else:
            rng = random.Random(f"python_tool-{seed}")
            held = [procedural(rng, digits) for _ in range(num_heldout)]
            seen = {p.question for p in held}
            self.problems = [p for p in (procedural(rng, digits) for _ in range(size)) if p.question not in seen]
            self.heldout_problems = held
        if not self.problems:
            raise EnvError(f"{path}: no training problems left after holding out {len(self.heldout_problems)}")

    def _rows(self, path: str) -> list[Problem]:
        rows, self._reports[path] = read_rows(path, (("problem", "question"), ("answer", "solution")),
                                              optional=("code",))
        return [Problem(str(r["problem"]), str(r["answer"]), exact=False, code=str(r.get("code") or "")) for r in rows]

    def builder(self, group_id: str, p: Problem) -> ToolGroupBuilder:
        return ToolGroupBuilder(group_id, p, self.render(p.question), self.max_tokens, self.max_turns, self.limits)

    @property
    def num_train(self) -> int:
        return len(self.problems)

    def train_builder(self, group_id: str, k: int) -> ToolGroupBuilder:
        return self.builder(group_id, self.problems[k])

    def solved(self, k: int) -> tuple[str, str]:
        """A worked transcript for warm-up: one tool call that computes the answer, its output, the
        answer (procedural problems: their expression in Python; file rows: their `code`, or else
        the answer alone)."""
        p = self.problems[k]
        code = p.code or (f"print({_expression(p.question)})" if _expression(p.question) else "")
        if not code:
            return p.question, f"<answer>{p.answer}</answer>"
        return p.question, f"<python>{code}</python>\n<output>\n{p.answer}\n</output>\n<answer>{p.answer}</answer>"

    def heldout(self) -> list[ToolGroupBuilder]:
        return [self.builder(f"heldout-{k}", p) for k, p in enumerate(self.heldout_problems)]


def _expression(question: str) -> str:
    """The Python expression of a procedural question ('' for any other)."""
    m = re.fullmatch(r"What is (\d+) \* (\d+)\?", question)
    if m:
        return f"{m[1]}*{m[2]}"
    m = re.fullmatch(r"What is the sum of ([\d, ]+)\?", question)
    if m:
        return f"sum([{m[1]}])"
    m = re.fullmatch(r"What is (\d+) mod (\d+)\?", question)
    return f"{m[1]}%{m[2]}" if m else ""


def make_suite(spec, tokenizer, seed: int) -> PythonToolSuite:
    template = DEFAULT_TEMPLATE if spec.prompt_template == "{question}\nAnswer: " else spec.prompt_template
    return PythonToolSuite(tokenizer, path=spec.path, test_path=spec.test_path, num_heldout=spec.num_heldout,
                           size=spec.size, seed=seed, digits=spec.digits, prompt_template=template, chat_template=spec.chat_template,
                           max_tokens=spec.max_tokens, max_turns=spec.max_turns, limits=spec.sandbox)
