"""The shared base of text-problem suites (`math`, `reasoning_gym`).

A problem is a question; its prompt is `env.prompt_template` with the question in it (optionally
wrapped in the tokenizer's chat template). An episode is one turn: the completion is decoded and
scored by the suite's own grader. Training batches are per-epoch shuffles of the training
problems; warm-up examples are the problems with their reference answers, or rows of a data file.
A suite says how to read its problems (`num_train`, `train_builder`, `solved`, `heldout`); the
rest is here.
"""

from __future__ import annotations

from typing import Sequence

from lockstep.envs.prompts import check_prompt_settings, render_prompt
from lockstep.envs.rows import EpochBatches, sft_from_file
from lockstep.envs.types import DataReport, EnvError, EnvSnapshot, Observation, SFTExample, StepResult, restore_state


class SingleTurnEnv:
    """One episode: the prompt, one completion, the grader's score of it."""

    def __init__(self, prompt: tuple[int, ...], tokenizer, *, max_tokens: int):
        self.prompt, self.tokenizer, self.max_tokens = prompt, tokenizer, max_tokens

    async def initial_observation(self) -> Observation:
        return Observation(self.prompt, None, self.max_tokens)

    async def score(self, completion: str) -> tuple[float, bool]:
        """(reward, whether the answer is correct) for the decoded completion."""
        raise NotImplementedError

    async def step(self, action: Sequence[int]) -> StepResult:
        completion = self.tokenizer.decode(list(action), skip_special_tokens=True)
        reward, correct = await self.score(completion)
        return StepResult(reward, True, metrics={"correct": 1.0 if correct else 0.0})

    def snapshot(self) -> EnvSnapshot:
        return EnvSnapshot.of(self, None)  # single turn: no state between steps, but a typed snapshot

    def restore(self, snapshot: EnvSnapshot) -> None:
        restore_state(self, snapshot)


def require_sandbox(env_name: str) -> None:
    """EnvError, at suite construction, when an env that runs model-written programs has no sandbox
    here (the reason and the fix in the message) rather than a failure at every step."""
    from lockstep.sandbox.bwrap import check_available
    from lockstep.sandbox.types import SandboxUnavailable

    try:
        check_available()
    except SandboxUnavailable as e:
        raise EnvError(f"env.name = {env_name!r} runs model-written programs: {e}") from None


def split_heldout(rows: list, heldout: list | None, num_heldout: int) -> tuple[list, list]:
    """(training rows, held-out rows): `heldout` when a test file gave them, else the end of `rows`,
    at most `num_heldout` and at most a quarter of them."""
    if heldout is not None:
        return rows, heldout
    k = min(num_heldout, len(rows) // 4)
    return rows[:len(rows) - k], rows[len(rows) - k:]


class TextTrainBatches:
    """Batches of training problems' group builders, a fresh shuffle each epoch."""

    def __init__(self, suite: "TextSuite", batch_size: int):
        self.suite = suite
        self.batches = EpochBatches(suite.num_train, batch_size, suite.seed)

    def get_batch(self, index: int) -> list:
        s = self.suite
        return [s.train_builder(f"{s.group_prefix}-{index}-{j}", k) for j, k in enumerate(self.batches.indices(index))]

    def __len__(self) -> int:
        return len(self.batches)


class TextSolvedBatches:
    """Supervised examples from the training problems: the prompt, then the reference answer and EOS."""

    def __init__(self, suite: "TextSuite", batch_size: int):
        self.suite = suite
        self.batches = EpochBatches(suite.num_train, batch_size, suite.seed)

    def get_batch(self, index: int) -> list[SFTExample]:
        s, eos = self.suite, self.suite.tokenizer.eos_token_id
        return [SFTExample(s.render(question), tuple(s.tokenizer.encode(answer)) + (eos,))
                for question, answer in (s.solved(k) for k in self.batches.indices(index))]

    def __len__(self) -> int:
        return len(self.batches)


class TextSuite:
    """What every text-problem suite shares: prompt rendering, batches, warm-up data, reports."""

    name: str
    group_prefix: str
    """Training group ids are "<group_prefix>-<batch>-<index>"."""

    def __init__(self, tokenizer, *, seed: int, prompt_template: str, chat_template: bool, max_tokens: int):
        check_prompt_settings(tokenizer, template=prompt_template, chat=chat_template)
        self.tokenizer, self.seed, self.max_tokens = tokenizer, seed, max_tokens
        self.prompt_template, self.chat_template = prompt_template, chat_template
        self._reports: dict[str, DataReport] = {}

    # -- what a suite provides ---------------------------------------------------------------
    @property
    def num_train(self) -> int:
        """Training problems (an epoch)."""
        raise NotImplementedError

    def train_builder(self, group_id: str, k: int):
        """The group builder of training problem `k`."""
        raise NotImplementedError

    def solved(self, k: int) -> tuple[str, str]:
        """(question, reference answer) of training problem `k`, for warm-up."""
        raise NotImplementedError

    def heldout(self) -> list:
        raise NotImplementedError

    def check_solvable(self) -> None:
        """Raise EnvError, at stage start, when the suite has no reference answers to warm up on."""

    # -- shared ------------------------------------------------------------------------------
    def render(self, question: str) -> tuple[int, ...]:
        return render_prompt(self.tokenizer, question, template=self.prompt_template, chat=self.chat_template)

    def train(self, batch_size: int) -> TextTrainBatches:
        return TextTrainBatches(self, batch_size)

    def sft(self, batch_size: int, path: str = ""):
        if not path:
            self.check_solvable()
            return TextSolvedBatches(self, batch_size)
        dataset, self._reports[path] = sft_from_file(path, self.tokenizer, batch_size=batch_size, seed=self.seed,
                                                     render_prompt=self.render)
        return dataset

    @property
    def data_reports(self) -> dict[str, DataReport]:
        return dict(self._reports)
