"""Token choice: temperature, top-k, top-p and a counter-based RNG, vectorised over rows.

Each row draws from its own stream, keyed by (seed, step), so a sample depends only on its own
seed and logits, never on what else shares the batch. Since the forward is batch-invariant too,
the same seed and prompt give the same completion in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lockstep.engine.invariant import log_softmax

_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer kept inside int64 without overflow (multipliers < 2^31)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def uniform(keys_R: torch.Tensor, step: int) -> torch.Tensor:
    """One float64 uniform in (0, 1) per row, a pure function of (row key, step)."""
    h = _hash32(keys_R ^ (_splitmix64(step) & _M32))
    return (h.double() + 0.5) / 4294967296.0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def row_seed(seed: int, index: int) -> int:
    """RNG key of sample `index` of a request seeded with `seed`: 32 well-mixed bits, stable across runs."""
    return _splitmix64(_splitmix64(seed & 0xFFFFFFFFFFFFFFFF) ^ index) >> 32


@dataclass
class RowParams:
    """Per-row sampling settings as tensors (R rows)."""

    temperature: torch.Tensor  # float32 (R,)
    top_k: torch.Tensor  # int64 (R,), -1 = off
    top_p: torch.Tensor  # float32 (R,)
    seeds: torch.Tensor  # int64 (R,)

    def select(self, rows: torch.Tensor) -> "RowParams":
        return RowParams(*(t.index_select(0, rows) for t in (self.temperature, self.top_k, self.top_p, self.seeds)))

    @property
    def plain(self) -> bool:
        """True when every row samples from the model's own distribution (T=1, no truncation)."""
        return bool((self.temperature == 1).all() and (self.top_k == -1).all() and (self.top_p >= 1).all())


def _truncate(scaled: torch.Tensor, p: RowParams) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p set with -inf."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    V = scaled.shape[-1]
    rank = torch.arange(V).expand_as(sorted_logits)
    k = torch.where(p.top_k > 0, p.top_k, V).unsqueeze(1)
    drop = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop |= mass_before >= p.top_p.unsqueeze(1)
    drop[:, 0] = False  # always keep the most likely token
    mask = torch.zeros_like(drop).scatter(1, order, drop)
    return scaled.masked_fill(mask, float("-inf"))


def choose(logits: torch.Tensor, p: RowParams, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return (tokens, logprob of each under the distribution used).

    Greedy rows (temperature 0) report the model's log p of the argmax token.
    """
    model_logp = log_softmax(logits)
    if p.plain:
        dist_logp = model_logp
    else:
        greedy = p.temperature == 0
        temp = torch.where(greedy, torch.ones_like(p.temperature), p.temperature).unsqueeze(1)
        scaled = logits / temp
        if bool(((p.top_k > 0) | (p.top_p < 1)).any()):
            scaled = _truncate(scaled, p)
        dist_logp = log_softmax(scaled)
    cdf = torch.cumsum(torch.exp(dist_logp.double()), dim=-1)
    u = uniform(p.seeds, step) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    if not p.plain:
        greedy = p.temperature == 0
        if bool(greedy.any()):
            tokens = torch.where(greedy, logits.argmax(-1), tokens)
            dist_logp = torch.where(greedy.unsqueeze(1), model_logp, dist_logp)
    return tokens, dist_logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
