"""`arithmetic`: procedural integer addition, the embedded default task; `long_addition`: the same
problems answered with a worked, digit-by-digit scratchpad (long completions).

A problem is "a+b=" with a, b drawn uniformly from [0, 10**digits); the answer is the decimal sum
followed by EOS. Reward is 1 for an exact answer and 0 otherwise. The held-out set is drawn from its
own seed and excluded from training, so evaluation never sees a training problem.

`long_addition` answers column by column from the right, each step "x+y+c=ss" (the column's digits,
the carry in, the two-digit column sum whose first digit is the next carry), steps separated by
"|", then "|" and the sum: 4821+3967 -> "1+7+0=08|2+6+0=08|8+9+0=17|4+3+1=08|08788". At 7 digits
(its default) an answer is 71 tokens of the built-in tokenizer plus EOS. Only the final sum is
graded (the scratchpad is the model's working): the text after the last "|", then EOS.

With `max_turns > 1` an episode is multi-turn: after a wrong answer the env appends feedback and
the prompt again, and the model answers once more; a correct answer on turn t earns 0.5**(t-1).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from lockstep.envs.types import DataReport, EnvSnapshot, Observation, SFTExample, StepResult, restore_state

FEEDBACK = " no; "
"""Text the multi-turn env inserts after a wrong answer, before repeating the prompt."""


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    width: int = 0
    """0: plain decimals ("7+25=32"); w > 0: operands zero-padded to w digits and the sum to w + 1
    ("007+025=0032"), which puts every digit at a fixed offset and makes the task far easier to
    learn for a small model."""

    @property
    def prompt(self) -> str:
        w = self.width
        return f"{self.a:0{w}d}+{self.b:0{w}d}=" if w else f"{self.a}+{self.b}="

    scratchpad: bool = False
    """long_addition: the answer is worked column by column (see the module docstring)."""

    @property
    def result(self) -> str:
        return f"{self.a + self.b:0{self.width + 1}d}" if self.width else str(self.a + self.b)

    @property
    def answer(self) -> str:
        return f"{worked_columns(self.a, self.b, self.width)}|{self.result}" if self.scratchpad else self.result


def worked_columns(a: int, b: int, width: int) -> str:
    """The scratchpad of a + b over `width` columns, least significant first."""
    steps, carry = [], 0
    for i in range(width):
        x, y = a // 10**i % 10, b // 10**i % 10
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s:02d}")
        carry = s // 10
    return "|".join(steps)


def is_correct(problem: Problem, tokens: Sequence[int], tokenizer) -> bool:
    """Exact match: the answer's digits, then EOS, and nothing else (with a scratchpad: the text
    after its last "|")."""
    eos = tokenizer.eos_token_id
    if not (len(tokens) > 0 and tokens[-1] == eos):
        return False
    text = tokenizer.decode(list(tokens[:-1]))
    return (text.rpartition("|")[2] if problem.scratchpad else text) == problem.result


class ArithmeticEnv:
    """One episode: one problem, up to `max_turns` answers."""

    def __init__(self, problem: Problem, tokenizer, *, max_tokens: int, max_turns: int = 1):
        self.problem = problem
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        self.context: tuple[int, ...] = ()
        self.turn = 0

    async def initial_observation(self) -> Observation:
        self.context, self.turn = tuple(self.tokenizer.encode(self.problem.prompt)), 0
        return Observation(self.context, None, self.max_tokens)

    async def step(self, action: Sequence[int]) -> StepResult:
        self.turn += 1
        correct = is_correct(self.problem, action, self.tokenizer)
        if correct or self.turn >= self.max_turns:
            reward = 0.5 ** (self.turn - 1) if correct else 0.0
            return StepResult(reward, True, metrics={"correct": float(correct), "turns": float(self.turn)})
        retry = tuple(self.tokenizer.encode(FEEDBACK + self.problem.prompt))
        self.context = self.context + tuple(action) + retry
        return StepResult(0.0, False, Observation(self.context, None, self.max_tokens))

    def snapshot(self) -> EnvSnapshot:
        return EnvSnapshot.of(self, (self.context, self.turn))

    def restore(self, snapshot: EnvSnapshot) -> None:
        self.context, self.turn = restore_state(self, snapshot)


@dataclass(frozen=True)
class ArithmeticGroupBuilder:
    group_id: str
    problem: Problem
    max_tokens: int
    max_turns: int = 1

    def make_envs(self, group_size: int, tokenizer) -> list[ArithmeticEnv]:
        return [ArithmeticEnv(self.problem, tokenizer, max_tokens=self.max_tokens, max_turns=self.max_turns)
                for _ in range(group_size)]


class ArithmeticTask:
    """Deterministic problem streams: training batches and a fixed held-out set."""

    def __init__(self, *, digits: int = 3, seed: int = 0, num_heldout: int = 200, padded: bool = True,
                 scratchpad: bool = False):
        self.digits = digits
        self.seed = seed
        self.width = digits if padded or scratchpad else 0
        self.scratchpad = scratchpad
        hi = 10**digits
        rng = random.Random(f"heldout-{seed}-{digits}")
        self.heldout = [Problem(rng.randrange(hi), rng.randrange(hi), self.width, scratchpad) for _ in range(num_heldout)]
        self._heldout_set = set(self.heldout)

    def problems(self, index: int, count: int, *, stream: str = "train") -> list[Problem]:
        """`count` training problems for batch `index` of a stream, a pure function of its arguments."""
        rng = random.Random(f"{stream}-{self.seed}-{self.digits}-{index}")
        hi = 10**self.digits
        out: list[Problem] = []
        while len(out) < count:
            p = Problem(rng.randrange(hi), rng.randrange(hi), self.width, self.scratchpad)
            if p not in self._heldout_set:
                out.append(p)
        return out

    @staticmethod
    def sft_text(p: Problem) -> str:
        return p.prompt + p.answer


PROCEDURAL_BATCHES = 2**31
"""`len()` of a procedural dataset: it never runs out."""


class _TrainBatches:
    def __init__(self, suite: "ArithmeticSuite", batch_size: int):
        self.suite, self.batch_size = suite, batch_size

    def get_batch(self, index: int) -> list[ArithmeticGroupBuilder]:
        s = self.suite
        return [ArithmeticGroupBuilder(f"arith-{index}-{i}", p, s.max_tokens, s.max_turns)
                for i, p in enumerate(s.task.problems(index, self.batch_size, stream="rl"))]

    def __len__(self) -> int:
        return PROCEDURAL_BATCHES


class _SolvedBatches:
    def __init__(self, suite: "ArithmeticSuite", batch_size: int):
        self.suite, self.batch_size = suite, batch_size

    def get_batch(self, index: int) -> list[SFTExample]:
        tok, eos = self.suite.tokenizer, self.suite.tokenizer.eos_token_id
        return [SFTExample(tuple(tok.encode(p.prompt)), tuple(tok.encode(p.answer)) + (eos,))
                for p in self.suite.task.problems(index, self.batch_size, stream="sft")]

    def __len__(self) -> int:
        return PROCEDURAL_BATCHES


class ArithmeticSuite:
    name = "arithmetic"

    def __init__(self, tokenizer, *, digits: int, seed: int, num_heldout: int, max_tokens: int, max_turns: int,
                 scratchpad: bool = False):
        self.tokenizer = tokenizer
        self.task = ArithmeticTask(digits=digits, seed=seed, num_heldout=num_heldout, scratchpad=scratchpad)
        if scratchpad:  # room for a whole worked answer, EOS, and a little more for a wrong one
            self.name = "long_addition"
            longest = len(tokenizer.encode(Problem(10**digits - 1, 10**digits - 1, digits, True).answer))
            max_tokens = max(max_tokens, longest + 8)
        self.seed, self.max_tokens, self.max_turns = seed, max_tokens, max_turns
        self._reports: dict[str, DataReport] = {}

    def train(self, batch_size: int) -> _TrainBatches:
        return _TrainBatches(self, batch_size)

    def heldout(self) -> list[ArithmeticGroupBuilder]:
        return [ArithmeticGroupBuilder(f"heldout-{i}", p, self.max_tokens, self.max_turns)
                for i, p in enumerate(self.task.heldout)]

    def sft(self, batch_size: int, path: str = ""):
        if not path:
            return _SolvedBatches(self, batch_size)
        from lockstep.envs.rows import sft_from_file

        dataset, self._reports[path] = sft_from_file(path, self.tokenizer, batch_size=batch_size, seed=self.seed)
        return dataset

    @property
    def data_reports(self) -> dict[str, DataReport]:
        return dict(self._reports)


def make_suite(spec, tokenizer, seed: int) -> ArithmeticSuite:
    return ArithmeticSuite(tokenizer, digits=spec.digits, seed=seed, num_heldout=spec.num_heldout,
                           max_tokens=spec.max_tokens, max_turns=spec.max_turns)


def make_long_suite(spec, tokenizer, seed: int) -> ArithmeticSuite:
    """`long_addition`: answers with a worked scratchpad (env.max_tokens is raised to fit one)."""
    return ArithmeticSuite(tokenizer, digits=spec.digits, seed=seed, num_heldout=spec.num_heldout,
                           max_tokens=spec.max_tokens, max_turns=spec.max_turns, scratchpad=True)
