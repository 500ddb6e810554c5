"""`arithmetic`: procedural integer addition, the embedded default task.

A problem is "a+b=" with a, b drawn uniformly from [0, 10**digits); the answer is the decimal sum
followed by EOS. Reward is 1 for an exact answer and 0 otherwise. The held-out set is drawn from its
own seed and excluded from training, so evaluation never sees a training problem.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from lockstep.envs.types import Observation, StepResult


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

    @property
    def answer(self) -> str:
        return f"{self.a + self.b:0{self.width + 1}d}" if self.width else str(self.a + self.b)


def is_correct(problem: Problem, tokens: Sequence[int], tokenizer) -> bool:
    """Exact match: the answer's digits, then EOS, and nothing else."""
    eos = tokenizer.eos_token_id
    return len(tokens) > 0 and tokens[-1] == eos and tokenizer.decode(list(tokens[:-1])) == problem.answer


class ArithmeticEnv:
    """One episode: one problem, one answer."""

    def __init__(self, problem: Problem, tokenizer, *, max_tokens: int):
        self.problem = problem
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens

    async def initial_observation(self) -> Observation:
        return Observation(tuple(self.tokenizer.encode(self.problem.prompt)), None, self.max_tokens)

    async def step(self, action: Sequence[int]) -> StepResult:
        correct = float(is_correct(self.problem, action, self.tokenizer))
        return StepResult(reward=correct, episode_done=True, metrics={"correct": correct})

    def snapshot(self) -> Problem:
        return self.problem

    def restore(self, snapshot: Problem) -> None:
        self.problem = snapshot


@dataclass(frozen=True)
class ArithmeticGroupBuilder:
    group_id: str
    problem: Problem
    tokenizer_dir: str
    max_tokens: int

    def make_envs(self, group_size: int, tokenizer=None):
        from transformers import AutoTokenizer

        tok = tokenizer or AutoTokenizer.from_pretrained(self.tokenizer_dir)
        return [ArithmeticEnv(self.problem, tok, max_tokens=self.max_tokens) for _ in range(group_size)]


class ArithmeticTask:
    """Deterministic problem streams: training batches and a fixed held-out set."""

    def __init__(self, *, digits: int = 3, seed: int = 0, num_heldout: int = 200, padded: bool = True):
        self.digits = digits
        self.seed = seed
        self.width = digits if padded else 0
        hi = 10**digits
        rng = random.Random(f"heldout-{seed}-{digits}")
        self.heldout = [Problem(rng.randrange(hi), rng.randrange(hi), self.width) for _ in range(num_heldout)]
        self._heldout_set = set(self.heldout)

    def problems(self, index: int, count: int, *, stream: str = "train") -> list[Problem]:
        """`count` training problems for batch `index` of a stream, a pure function of its arguments."""
        rng = random.Random(f"{stream}-{self.seed}-{self.digits}-{index}")
        hi = 10**self.digits
        out: list[Problem] = []
        while len(out) < count:
            p = Problem(rng.randrange(hi), rng.randrange(hi), self.width)
            if p not in self._heldout_set:
                out.append(p)
        return out

    @staticmethod
    def sft_text(p: Problem) -> str:
        return p.prompt + p.answer
