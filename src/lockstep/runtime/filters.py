"""In-loop data cleaning and advantage computation (pure functions over rollout groups)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from lockstep.advantages import get_estimator
from lockstep.runtime.types import RolloutGroup

Truncation = Literal["keep", "mask", "penalize"]


@dataclass(frozen=True)
class FilterReport:
    kept: tuple[RolloutGroup, ...]
    """Groups with a learning signal, cleaned."""
    no_signal: tuple[RolloutGroup, ...]
    """Zero-variance groups (every sample got the same reward): dropped, or used to complete a
    batch when refilling runs out."""
    stale: tuple[RolloutGroup, ...]
    """Groups past the staleness bound (to regenerate or drop)."""
    failed: tuple[RolloutGroup, ...]
    """Groups with a sample whose env failed every retry."""
    truncated: int
    """Samples that hit max_tokens without stopping."""
    repetitive: int
    """Samples flagged for degenerate repetition (counted, not removed)."""

    def counts(self) -> dict[str, int]:
        return {"filter/zero_variance": len(self.no_signal), "filter/stale": len(self.stale),
                "filter/truncated": self.truncated, "filter/repetitive": self.repetitive,
                "env/failed_groups": len(self.failed)}


def is_repetitive(tokens: Sequence[int], *, ngram: int = 3, max_repeats: int = 4) -> bool:
    """True when some n-gram occurs more than `max_repeats` times (a degenerate loop)."""
    if len(tokens) < ngram * (max_repeats + 1):
        return False
    counts: dict[tuple, int] = {}
    for i in range(len(tokens) - ngram + 1):
        key = tuple(tokens[i : i + ngram])
        counts[key] = counts.get(key, 0) + 1
        if counts[key] > max_repeats:
            return True
    return False


def too_stale(group: RolloutGroup, trainer_version: int, max_staleness: int) -> bool:
    """The staleness bound: trained at `trainer_version`, may this group still be used?"""
    return trainer_version - group.version > max_staleness


def _truncation(samples, policy: Truncation, reward: float):
    """mask: truncated samples leave the group (no advantage, no loss); penalize: their reward
    becomes `reward`; keep: unchanged."""
    if policy == "mask":
        return [s for s in samples if s.stop_reason != "length"]
    if policy == "penalize":
        return [dataclasses.replace(s, reward=reward) if s.stop_reason == "length" else s for s in samples]
    return list(samples)


def clean(groups: Sequence[RolloutGroup], *, trainer_version: int, max_staleness: int,
          truncation: Truncation = "keep", truncated_reward: float = 0.0) -> FilterReport:
    """Env failures, the staleness gate, truncation and zero-variance dropping, with counts."""
    kept, flat, stale, failed, truncated, repetitive = [], [], [], [], 0, 0
    for g in groups:
        if g.failed:
            failed.append(g)
            continue
        if too_stale(g, trainer_version, max_staleness):
            stale.append(g)
            continue
        truncated += sum(s.stop_reason == "length" for s in g.samples)
        repetitive += sum(is_repetitive(s.tokens) for s in g.samples)
        samples = _truncation(g.samples, truncation, truncated_reward)
        group = dataclasses.replace(g, samples=tuple(samples))
        rewards = np.array([s.reward for s in samples])
        (kept if len(samples) >= 2 and np.any(rewards != rewards[0]) else flat).append(group)
    return FilterReport(tuple(kept), tuple(flat), tuple(stale), tuple(failed), truncated, repetitive)


def _families(samples) -> list[list[int]]:
    """Sample indices by family: the branches of one forked episode together, every other sample alone."""
    by_family: dict[int, list[int]] = {}
    out: list[list[int]] = []
    for i, s in enumerate(samples):
        if s.family < 0:
            out.append([i])
        else:
            if s.family not in by_family:
                by_family[s.family] = []
                out.append(by_family[s.family])
            by_family[s.family].append(i)
    return out


def token_advantages(samples, estimator) -> list[tuple[float, float]]:
    """Per sample, (advantage of its shared prefix, advantage of the rest).

    Unforked, they are equal: the group-relative advantage of its reward. A forked episode's
    family is valued at its branches' mean reward: the prefix gets that value's advantage among
    the group's families, and each branch's continuation its reward minus the family's value (a
    per-turn advantage from the branches, as in tree search / VinePPO's Monte Carlo values)."""
    families = _families(samples)
    values = np.array([np.mean([samples[i].reward for i in f]) for f in families], dtype=np.float64)
    family_adv = estimator(values) if len(families) >= 2 else np.zeros(len(families))
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(samples)
    for members, value, a in zip(families, values, family_adv):
        for i in members:
            rest = a if len(members) == 1 and samples[i].fork_at == 0 else samples[i].reward - value
            out[i] = (float(a), float(rest))
    return out


def to_datums(groups: Sequence[RolloutGroup], *, estimator: str = "grpo"):
    """Policy-gradient datums: sampled tokens carry the sample's group-centred advantage, the
    sampler's exact logprobs, weight 1 and sequence_ratio_mask 1 (gspo's); prompt and env-inserted
    tokens carry 0 in both and no advantage. With forked episodes, the advantages are per segment
    (`token_advantages`), and a family's shared prefix is trained once, in the branch that owns it.

    Returns (datums, sampled_from): where each datum's sampled tokens start, for the mismatch panel.
    """
    from lockstep.engine.types import Datum

    advantage = get_estimator(estimator)
    data, sampled_from = [], []
    for g in groups:
        if len(g.samples) < 2:
            continue  # a masked-down group: no baseline, so no signal
        segments = token_advantages(g.samples, advantage)  # unforked: each sample's own group advantage
        n = len(g.prompt)
        for s, (a_prefix, a_rest) in zip(g.samples, segments):
            if not s.tokens:
                continue
            mask = np.array([s.is_sampled(i) for i in range(len(s.tokens))], np.float32)
            if not s.owns_prefix:
                mask[:s.fork_at] = 0.0  # the family's prefix is trained in its owner's datum
            per_token = np.full(len(s.tokens), np.float32(a_rest), np.float32)
            per_token[:s.fork_at] = np.float32(a_prefix)
            full = list(g.prompt) + list(s.tokens)
            pad = np.zeros(n - 1, np.float32)
            inputs = {
                "target_tokens": np.asarray(full[1:], np.int64),
                "logprobs": np.concatenate([pad, np.asarray(s.logprobs, np.float32) * mask]),
                "advantages": np.concatenate([pad, per_token * mask]),
                "weights": np.concatenate([pad, mask]),
                "sequence_ratio_mask": np.concatenate([pad, mask]),  # gspo: the ratio over sampled tokens only
            }
            data.append(Datum(tuple(full[:-1]), inputs))
            sampled_from.append(n - 1)
    return data, sampled_from
