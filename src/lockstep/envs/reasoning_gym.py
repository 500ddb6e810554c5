"""`reasoning_gym`: a procedural task from the reasoning-gym library, scored by the task's own scorer.

Training problems are items of `create_dataset(env.task, size=env.size, seed=seed)`; the held-out
set is a second dataset of `env.num_heldout` items whose seed starts right after the training
seeds (tasks draw item i from `Random(seed + i)`, so the two streams never share an RNG seed), and
a training item whose question is also held out is replaced by the next one. An episode is one
turn; the answer is the completion (or the inside of its last `<answer>...</answer>`), and the
reward is the task's `score_answer`, in [0, 1].

Builders carry the item (question, answer, metadata) and what identifies its dataset; the env's
process rebuilds that dataset once (`task_dataset`), since a scorer is a method of the dataset and
some read its config.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from lockstep.envs.text import SingleTurnEnv, TextSuite
from lockstep.envs.types import EnvError


@dataclass(frozen=True)
class TaskRef:
    """Which dataset an item came from, enough to rebuild it in another process."""

    task: str
    size: int
    seed: int


_DATASETS: dict[TaskRef, Any] = {}
"""This process's reasoning-gym datasets, built on first use."""


def task_dataset(ref: TaskRef):
    """The reasoning-gym dataset object `ref` names, cached per process."""
    if ref not in _DATASETS:
        _DATASETS[ref] = _create_dataset(ref.task, ref.size, ref.seed)
    return _DATASETS[ref]


def _create_dataset(task: str, size: int, seed: int):
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = difflib.get_close_matches(task, list(DATASETS), n=3, cutoff=0.5)
        hint = (f"did you mean {' or '.join(map(repr, close))}?" if close else
                f"its {len(DATASETS)} tasks include {', '.join(sorted(DATASETS)[:5])}, ... "
                f"(see reasoning_gym.factory.DATASETS)")
        raise EnvError(f"env.task: reasoning_gym has no task {task!r}; {hint}")
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed)
    except (ValueError, TypeError, AssertionError) as e:  # the task's config validation
        raise EnvError(f"env.task: reasoning_gym cannot build {task!r} with size={size}, seed={seed} "
                       f"({type(e).__name__}: {e})") from None


def extract_answer(completion: str) -> str:
    """The answer in a completion: inside its last `<answer>...</answer>` when there is one."""
    from reasoning_gym.utils import extract_answer as extract_tagged

    inner = extract_tagged(completion, tag_name="answer", strip=True)
    return (completion if inner is None else inner).strip()


class ReasoningGymEnv(SingleTurnEnv):
    """One single-turn episode, scored by the task's `score_answer`."""

    def __init__(self, ref: TaskRef, entry: dict, prompt: tuple[int, ...], tokenizer, *, max_tokens: int):
        super().__init__(prompt, tokenizer, max_tokens=max_tokens)
        self.ref, self.entry = ref, entry

    async def score(self, completion: str) -> tuple[float, bool]:
        score = float(task_dataset(self.ref).score_answer(answer=extract_answer(completion), entry=self.entry))
        return score, score == 1.0


@dataclass(frozen=True)
class ReasoningGymGroupBuilder:
    group_id: str
    ref: TaskRef
    index: int
    """The item's index in its dataset."""
    entry: dict = field(hash=False)
    """The item as reasoning-gym made it: question, answer (None for tasks without one), metadata."""
    prompt: tuple[int, ...]
    """The rendered prompt tokens (template and chat template already applied)."""
    max_tokens: int

    def make_envs(self, group_size: int, tokenizer) -> list[ReasoningGymEnv]:
        return [ReasoningGymEnv(self.ref, self.entry, self.prompt, tokenizer, max_tokens=self.max_tokens)
                for _ in range(group_size)]


class ReasoningGymSuite(TextSuite):
    name = "reasoning_gym"
    group_prefix = "rg"

    def __init__(self, tokenizer, *, task: str, size: int, num_heldout: int, seed: int, prompt_template: str,
                 chat_template: bool, max_tokens: int):
        super().__init__(tokenizer, seed=seed, prompt_template=prompt_template, chat_template=chat_template,
                         max_tokens=max_tokens)
        self.train_ref = TaskRef(task, size, seed)
        self.heldout_ref = TaskRef(task, num_heldout, seed + size)
        self.train_data = task_dataset(self.train_ref)
        heldout_data = task_dataset(self.heldout_ref)
        self.heldout_entries = [heldout_data[i] for i in range(num_heldout)]
        self._heldout_questions = {e["question"] for e in self.heldout_entries}

    def train_item(self, k: int) -> tuple[int, dict]:
        """Training item `k`, or the next one whose question is not held out."""
        size = self.train_ref.size
        for step in range(size):
            i = (k + step) % size
            entry = self.train_data[i]
            if entry["question"] not in self._heldout_questions:
                return i, entry
        raise EnvError(f"reasoning_gym task {self.train_ref.task!r}: every one of the {size} training problems is "
                       f"also in the held-out set; the task has too few distinct problems for env.num_heldout = "
                       f"{self.heldout_ref.size}")

    def require_answer(self, entry: dict) -> None:
        if entry.get("answer") is None:
            raise EnvError(f"reasoning_gym task {self.train_ref.task!r} has no reference answers to train on; "
                           f"give the sft stage a data file of prompts and completions")

    @property
    def num_train(self) -> int:
        return self.train_ref.size

    def train_builder(self, group_id: str, k: int) -> ReasoningGymGroupBuilder:
        i, entry = self.train_item(k)
        return ReasoningGymGroupBuilder(group_id, self.train_ref, i, entry, self.render(entry["question"]),
                                        self.max_tokens)

    def solved(self, k: int) -> tuple[str, str]:
        _, entry = self.train_item(k)
        self.require_answer(entry)
        return entry["question"], str(entry["answer"])

    def check_solvable(self) -> None:
        self.require_answer(self.train_item(0)[1])  # fail at stage start, not at the first batch

    def heldout(self) -> list[ReasoningGymGroupBuilder]:
        return [ReasoningGymGroupBuilder(f"heldout-{k}", self.heldout_ref, k, e, self.render(e["question"]),
                                         self.max_tokens)
                for k, e in enumerate(self.heldout_entries)]


def make_suite(spec, tokenizer, seed: int) -> ReasoningGymSuite:
    return ReasoningGymSuite(tokenizer, task=spec.task, size=spec.size, num_heldout=spec.num_heldout, seed=seed,
                             prompt_template=spec.prompt_template, chat_template=spec.chat_template,
                             max_tokens=spec.max_tokens)
