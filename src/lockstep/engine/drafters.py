"""Drafters for speculative decoding: they propose the next tokens of a row, cheaply; the target
model then verifies them (engine/speculative.py). A drafter only changes how fast a completion comes,
never what is sampled, so a bad draft costs speed, not correctness.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from lockstep.config.types import DRAFTERS
from lockstep.engine.types import EngineError


def make_drafter(name: str, *, target=None, tokenizer=None, **options):
    """The drafter called `name` (one of config.types.DRAFTERS; None for "off"), built with its own
    options; "model" drafts with a small model made from (or checked against) the target
    InvariantLM and its tokenizer."""
    factories = {"off": lambda: None, "suffix": lambda: SuffixDrafter(**options), "model": lambda: _model(target, tokenizer, options)}
    assert set(factories) == set(DRAFTERS), "engine/drafters.py and config.types.DRAFTERS disagree"
    if name not in factories:
        raise EngineError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
    return factories[name]()


def _model(target, tokenizer, options):
    from lockstep.engine.draft_model import ModelDrafter

    if target is None or tokenizer is None:
        raise EngineError("the model drafter needs the target model and its tokenizer")
    return ModelDrafter(target, tokenizer, **options)


class _PromptIndex:
    """Every sequence seen for one prompt (the prompt itself, its earlier completions, the rows now
    being sampled), indexed by their n-grams: n-gram -> (sequence, index of the token after the
    most recent occurrence). Only occurrences with at least one following token are indexed."""

    def __init__(self, prompt: Sequence[int], max_ngram: int):
        self.max_ngram = max_ngram
        self.index: dict[tuple[int, ...], tuple[list[int], int]] = {}
        self.completions: list[list[int]] = []
        self._add_all(list(prompt))

    def _add_all(self, seq: list[int]) -> None:
        for i in range(1, len(seq)):
            self.add(seq, i)

    def add(self, seq: list[int], i: int) -> None:
        """Index the n-grams that end just before seq[i] (seq[i] now exists)."""
        for n in range(1, min(self.max_ngram, i) + 1):
            self.index[tuple(seq[i - n : i])] = (seq, i)

    def propose(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens: what followed the longest recent match of seq's suffix, and, while that
        runs out early (the match was near the end of its sequence, as in any repetition), what
        followed the match of the suffix extended by the draft so far."""
        out: list[int] = []
        while len(out) < k:
            tail = (seq[-self.max_ngram :] + out)[-self.max_ngram :]
            more = self._continuation(tail, k - len(out))
            if not more:
                break
            out += more
        return out

    def _continuation(self, tail: list[int], k: int) -> list[int]:
        for n in range(len(tail), 0, -1):
            hit = self.index.get(tuple(tail[-n:]))
            if hit is not None:
                source, j = hit
                return source[j : j + k]
        return []


class SuffixDrafter:
    """Model-free drafting from a suffix index over the sequences of the same prompt: the other
    samples of the same request (a GRPO group's siblings) and the last `window` completions of that
    prompt in earlier calls (RL re-samples the same prompts every epoch), plus the prompt itself.
    A row's draft is what followed the longest recent match (up to `max_ngram` tokens) of its own
    last tokens. The indexes of the `max_prompts` most recently seen prompts are kept."""

    def __init__(self, *, max_ngram: int = 4, window: int = 16, max_prompts: int = 1024):
        for key, value, least in (("max_ngram", max_ngram, 1), ("window", window, 0), ("max_prompts", max_prompts, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise EngineError(f"suffix drafter: {key} must be an integer >= {least}, got {value!r}")
        self.max_ngram, self.window, self.max_prompts = max_ngram, window, max_prompts
        self._prompts: OrderedDict[tuple[int, ...], _PromptIndex] = OrderedDict()

    def session(self, prompts: Sequence[Sequence[int]], **context) -> "SuffixSession":
        """Start drafting for one sample() call; prompts[r] is row r's prompt (the sampler's
        context, its cache capacity and policy version, is not needed here)."""
        return SuffixSession(self, [self._index(tuple(p)) for p in prompts], prompts)

    def _index(self, prompt: tuple[int, ...]) -> _PromptIndex:
        idx = self._prompts.pop(prompt, None) or _PromptIndex(prompt, self.max_ngram)
        self._prompts[prompt] = idx  # most recently used last
        while len(self._prompts) > self.max_prompts:
            self._prompts.popitem(last=False)
        return idx

    def _remember(self, idx: _PromptIndex, prompt: tuple[int, ...], completion: list[int]) -> None:
        """Keep a finished completion; past the window, rebuild the index from what remains (the
        index only grows otherwise, so rebuilding keeps it to about twice the window)."""
        idx.completions.append(completion)
        if len(idx.completions) > 2 * max(self.window, 1):
            idx.completions = idx.completions[-self.window :] if self.window else []
            fresh = _PromptIndex(prompt, self.max_ngram)
            for seq in idx.completions:
                fresh._add_all(seq)
            idx.index = fresh.index


class SuffixSession:
    """One sample() call's rows: each row's sequence (prompt + tokens so far) and its prompt's index."""

    def __init__(self, drafter: SuffixDrafter, indexes: list[_PromptIndex], prompts):
        self.drafter = drafter
        self.indexes = indexes
        self.prompts = [tuple(p) for p in prompts]
        self.seqs = [list(p) for p in prompts]

    def append(self, row: int, tokens: Sequence[int]) -> None:
        seq, idx = self.seqs[row], self.indexes[row]
        for t in tokens:
            seq.append(int(t))
            idx.add(seq, len(seq) - 1)

    def propose(self, row: int, k: int) -> list[int]:
        return self.indexes[row].propose(self.seqs[row], k) if k > 0 else []

    def finish(self) -> None:
        """Remember every row's completion for later calls with the same prompt."""
        for seq, idx, prompt in zip(self.seqs, self.indexes, self.prompts):
            self.drafter._remember(idx, prompt, seq)
