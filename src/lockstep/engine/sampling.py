"""Token choice: temperature, top-k, top-p and a counter-based RNG, vectorised over rows.

Each row draws from its own stream, keyed by (seed, step), so a sample depends only on its own
seed and logits, never on what else shares the batch. Since the forward is batch-invariant too,
the same seed and prompt give the same completion in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

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


def uniform(keys_R: torch.Tensor, steps_R: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in (0, 1) per row, a pure function of (row key, row step)."""
    distinct, where = torch.unique(steps_R, return_inverse=True)  # one Python mix per distinct step
    mixed = torch.tensor([_splitmix64(s) & _M32 for s in distinct.tolist()], dtype=torch.int64)[where]
    h = _hash32(keys_R ^ mixed)
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

    @cached_property
    def greedy_R(self) -> torch.Tensor:
        return self.temperature == 0

    @cached_property
    def plain_R(self) -> torch.Tensor:
        """Rows that sample from the model's own distribution (T=1, no truncation)."""
        return (self.temperature == 1) & (self.top_k == -1) & (self.top_p >= 1)

    @cached_property
    def shaped_rows(self) -> torch.Tensor | None:
        """Indices of the rows with a temperature other than 0 and 1, or top-k / top-p; None if none.
        (Cached, like the masks: a decode step asks every time, and the rows change only on select.)"""
        rows = (~(self.plain_R | self.greedy_R)).nonzero().squeeze(1)
        return rows if rows.numel() else None

    @cached_property
    def any_greedy(self) -> bool:
        return bool(self.greedy_R.any())


def _truncate(scaled: torch.Tensor, p: RowParams) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p set with -inf. A row without top-k
    (top_k=-1) or top-p (top_p=1) is not touched by that rule: its cumulative mass may round to 1
    before the last token, and dropping the tail then would change its logprobs."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    V = scaled.shape[-1]
    rank = torch.arange(V).expand_as(sorted_logits)
    k = torch.where(p.top_k > 0, p.top_k, V).unsqueeze(1)
    drop = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop |= (mass_before >= p.top_p.unsqueeze(1)) & (p.top_p < 1).unsqueeze(1)
    drop[:, 0] = False  # always keep the most likely token
    mask = torch.zeros_like(drop).scatter(1, order, drop)
    return scaled.masked_fill(mask, float("-inf"))


def _shaped_logp(logits: torch.Tensor, p: RowParams, lsm=log_softmax) -> torch.Tensor:
    """log p of the distribution each (non-plain, non-greedy) row samples from: temperature, then
    its own top-k / top-p, if any."""
    scaled = logits.float() / p.temperature.unsqueeze(1)
    truncating = (p.top_k > 0) | (p.top_p < 1)
    if bool(truncating.any()):
        scaled = torch.where(truncating.unsqueeze(1), _truncate(scaled, p), scaled)
    return lsm(scaled)


def _fused_sample_rows():
    from lockstep.engine import kernels

    if kernels.load() is None:
        return None
    from lockstep.engine.fused import sample_rows

    return sample_rows


_sample_rows = _fused_sample_rows()


def _draw(logp: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, ops=None) -> torch.Tensor:
    """Inverse-CDF draw per row at its counter-RNG uniform (one kernel call when built)."""
    if ops is not None:
        return ops.sample_rows(logp, seeds, steps)
    if _sample_rows is not None:
        return _sample_rows(logp, seeds, steps)
    cdf = torch.cumsum(torch.exp(logp.double()), dim=-1)
    u = uniform(seeds, steps) * cdf[:, -1]
    return torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1).clamp_(max=logp.shape[-1] - 1)


def choose(logits: torch.Tensor, p: RowParams, step: int | torch.Tensor, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return (tokens, logprob of each under the distribution used)
    (choose_scored, without the model's log-softmax rows)."""
    return choose_scored(logits, p, step, ops)[:2]


def choose_scored(logits: torch.Tensor, p: RowParams, step: int | torch.Tensor,
                  ops=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row; return (tokens, logprob of each under the distribution used, the
    model's own log-softmax rows (R, V): the trainer's, which top-k logprobs are read from).

    `step` is the token index the rows draw for (their RNG counter): one int for all, or one per
    row (int64 (R,)), as a speculative verify needs. `ops`: the model's kernels (InvariantLM.ops:
    its log-softmax and draw are the ones the trainer's logprobs come from); None: the CPU ones.

    Each row gets its own parameters' treatment, whatever the other rows ask for: a plain row's
    distribution is exactly the model's `log_softmax` (the trainer's), a shaped row's is computed
    on its own rows only, and greedy rows (temperature 0) take the argmax and report the model's
    log p. Row-wise ops are batch-invariant, so a row never depends on what shares its batch.
    """
    lsm = ops.log_softmax if ops is not None else log_softmax
    dist_logp = model_logp = lsm(logits)
    rows = p.shaped_rows
    if rows is not None:
        dist_logp = model_logp.index_copy(0, rows, _shaped_logp(logits.index_select(0, rows), p.select(rows), lsm))
    steps = step if isinstance(step, torch.Tensor) else torch.full(p.seeds.shape, step, dtype=torch.int64)
    tokens = _draw(dist_logp, p.seeds, steps, ops)
    if p.any_greedy:
        tokens = torch.where(p.greedy_R, logits.argmax(-1), tokens)
    return tokens, dist_logp.gather(1, tokens.unsqueeze(1)).squeeze(1), model_logp
