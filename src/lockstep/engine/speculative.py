"""Speculative decoding over the invariant forward: draft k tokens per row, verify them in one
forward over the KV cache, keep the longest agreeing run.

Every emitted token is sampled exactly as plain decoding samples it: from the target's logits at
its position (bit for bit those of a one-token decode step, the forward being invariant in the
number of tokens fed) with the row's counter RNG at its token index. A drafted token is accepted
when that sample equals it. So speculation changes how many forwards a completion costs, never
what is sampled nor the logprobs reported: outputs equal plain decoding's, greedy or at any
temperature, top-k and top-p. For a deterministic draft d this is standard speculative sampling:
d is kept with probability p(d) = min(1, p(d)/q(d)) for q the point mass, and a rejected sample is
distributed as the normalised residual, p without d.

Cache rollback: the k+1 fed tokens are written at their positions; past the first rejection those
slots are zeroed again, so the cache is exactly what plain decoding would hold (attention never
looks past a query's own position, so they were invisible anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SpecStats:
    """Counters since the sampler was built: verify forwards, tokens drafted and accepted."""

    verify_steps: int = 0
    row_verifies: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    drafter_errors: int = 0
    plain_fallbacks: int = 0
    """sample() calls that finished without speculation because the drafter failed."""

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per row and verify forward."""
        return self.accepted / self.row_verifies if self.row_verifies else 0.0


def draft_block(session, rows: list[int], budgets: list[int], k: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts (R, k), lengths (R,)): each row's proposal, at most its budget, padded with `pad`."""
    out = torch.full((len(rows), k), pad, dtype=torch.long)
    lengths = torch.zeros(len(rows), dtype=torch.long)
    for i, (r, budget) in enumerate(zip(rows, budgets)):
        d = session.propose(r, min(k, budget))
        if d:
            out[i, : len(d)] = torch.tensor(d, dtype=torch.long)
            lengths[i] = len(d)
    return out, lengths


def rollback(cache, positions_R: torch.Tensor, fed_until_R: torch.Tensor) -> None:
    """Zero every layer's cache slots [positions_R[r], fed_until_R[r]) of each row r: the tokens fed
    there were rejected."""
    rows, slots = [], []
    for r, (a, b) in enumerate(zip(positions_R.tolist(), fed_until_R.tolist())):
        rows += [r] * (b - a)
        slots += range(a, b)
    if not rows:
        return
    rows_t, slots_t = torch.tensor(rows), torch.tensor(slots)
    for k, v in zip(cache.k, cache.v1):
        k[rows_t, :, slots_t] = 0.0
        v[rows_t, :, slots_t, : k.shape[-1]] = 0.0
