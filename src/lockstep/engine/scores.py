"""What the sampler reports beyond the sampled tokens: prompt logprobs, top-k lists, the logprobs
of named ids and draws at prompt positions (Tinker's sampling extras).

Every value is read from the log-softmax rows of the forward that samples (the prefill's for the
prompt, a decode or verify step's for a sampled token), through the model's own `logits` and
`log_softmax`, the ops the trainer's logprobs come from; those ops are row-invariant, so each
value is the trainer's for that token at that position, bit for bit, and a request's values do
not depend on what shares its batch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from lockstep.engine.sampling import row_seed
from lockstep.engine.types import SampleRequest, TokenLogprobs

PROMPT_CHUNK = 128
"""Prompt positions whose (positions, V) log-softmax rows are held at once: a long prompt's
scores cost PROMPT_CHUNK x V floats of memory, not len(prompt) x V."""

ALT_STREAM = 1 << 63
"""row_seed index of the alt draws' RNG stream: disjoint from the samples' (0 .. num_samples-1)."""


def top_k(logp_RV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row as (token ids int64 (R, k), logprobs (R, k)): larger
    logprob first, equal ones by smaller token id. A total order, so the first j of a row's top-k
    are its top-j whatever k was (a batch computes its widest k once). torch.topk leaves the order
    of ties unspecified, so it only finds each row's k-th value; the selection is done here."""
    R = logp_RV.shape[0]
    if R == 0 or k == 0:
        return torch.zeros(R, k, dtype=torch.long), torch.zeros(R, k, dtype=logp_RV.dtype)
    key = torch.where(torch.isnan(logp_RV), float("-inf"), logp_RV)  # a NaN row still yields k ids
    kth = key.topk(k, dim=-1).values[:, -1:]
    keep = key >= kth
    over = (keep.sum(-1) > k).nonzero().squeeze(1)  # ties across the k-th value: smaller ids first
    if over.numel():
        rows = key[over]
        above, tied = rows > kth[over], rows == kth[over]
        need = k - above.sum(-1, keepdim=True)
        keep[over] = above | (tied & (tied.to(torch.int32).cumsum(-1, dtype=torch.int32) <= need))
    ids = keep.nonzero()[:, 1].view(R, k)  # ascending ids within each row
    order = key.gather(1, ids).sort(dim=-1, descending=True, stable=True).indices
    ids = ids.gather(1, order)
    return ids, logp_RV.gather(1, ids)


@dataclass
class PromptScores:
    """One request's prompt extras (SampleResult's fields of the same names)."""

    prompt_logprobs: tuple[float, ...] | None = None
    topk_prompt_logprobs: TokenLogprobs | None = None
    target_prompt_logprobs: np.ndarray | None = None
    prompt_alt_tokens: TokenLogprobs | None = None


def score_prompt(model, hidden_1TH: torch.Tensor, request: SampleRequest, adapters) -> PromptScores:
    """The prompt extras `request` asks for, from its prefill's hidden states (1, >= len(prompt),
    H) and its adapter assignment (one row, or None)."""
    w = _Windows.of(request)
    out = _Outputs(request, hidden_1TH.device)
    prompt = torch.tensor(request.prompt, dtype=torch.long, device=hidden_1TH.device)
    for a in range(w.start, w.end, PROMPT_CHUNK):
        b = min(a + PROMPT_CHUNK, w.end)
        logp = model.log_softmax(model.logits(hidden_1TH[:, a:b], adapters))[0]  # row t - a: p(. | prompt[:t+1])
        out.fill(logp, a, b, prompt, w, model)
    return out.result()


@dataclass(frozen=True)
class _Windows:
    """Half-open ranges of prompt positions t (row t predicts prompt[t + 1]) that each extra scores."""

    logprobs: tuple[int, int]
    target: tuple[int, int]
    alt: tuple[int, int]
    start: int
    end: int

    @staticmethod
    def of(r: SampleRequest) -> "_Windows":
        L = len(r.prompt)
        n = r.prompt_logprobs_last_n
        logprobs = (L - 1 - n if n is not None else 0, L - 1) if (r.prompt_logprobs or r.topk_prompt_logprobs) \
            else (0, 0)
        target = (0, 0)
        if r.target_prompt_ids is not None:
            named = np.flatnonzero((r.target_prompt_ids >= 0).any(1))
            target = (int(named[0]), int(named[-1]) + 1)  # rows before the first named one are not scored
        alt = (0, L - 1) if r.prompt_alt_tokens_k else (0, 0)
        spans = [s for s in (logprobs, target, alt) if s[1] > s[0]]
        start, end = (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else (0, 0)
        return _Windows(logprobs, target, alt, start, end)


def _overlap(span: tuple[int, int], a: int, b: int) -> tuple[int, int]:
    return max(span[0], a), min(span[1], b)


class _Outputs:
    """The buffers one request's extras are written into, chunk by chunk."""

    def __init__(self, r: SampleRequest, device):
        L, self.r, self.device = len(r.prompt), r, device
        self.logprobs = torch.full((L,), math.nan) if r.prompt_logprobs else None
        k = r.topk_prompt_logprobs
        self.top = (torch.full((L, k), -1, dtype=torch.long), torch.full((L, k), math.nan)) if k else None
        ids = r.target_prompt_ids
        self.target_ids = torch.from_numpy(ids).to(device) if ids is not None else None
        self.target = torch.zeros(ids.shape, dtype=torch.float32) if ids is not None else None
        k = r.prompt_alt_tokens_k
        self.alt = (torch.zeros(L - 1, k, dtype=torch.long), torch.zeros(L - 1, k)) if k else None
        self.uniforms = _alt_uniforms(r) if k else None

    def fill(self, logp: torch.Tensor, a: int, b: int, prompt: torch.Tensor, w: _Windows, model) -> None:
        """Write what rows a..b-1 of the prompt (their log-softmax rows `logp`) hold for each extra."""
        s, e = _overlap(w.logprobs, a, b)
        if e > s:
            rows = logp[s - a : e - a]
            if self.logprobs is not None:
                self.logprobs[s + 1 : e + 1] = rows.gather(1, prompt[s + 1 : e + 1].unsqueeze(1)).squeeze(1).cpu()
            if self.top is not None:
                ids, lps = top_k(rows, self.r.topk_prompt_logprobs)
                self.top[0][s + 1 : e + 1], self.top[1][s + 1 : e + 1] = ids.cpu(), lps.cpu()
        s, e = _overlap(w.target, a, b)
        if e > s and self.target is not None:
            ids = self.target_ids[s:e]
            named = ids >= 0
            values = logp[s - a : e - a].gather(1, ids.clamp(min=0))
            self.target[s:e] = torch.where(named, values, torch.zeros_like(values)).cpu()
        s, e = _overlap(w.alt, a, b)
        if e > s and self.alt is not None:
            ids, lps = _draw_alternatives(logp[s - a : e - a], self.uniforms[s:e].to(logp.device),
                                          self.r.params.temperature, model)
            self.alt[0][s:e], self.alt[1][s:e] = ids.cpu(), lps.cpu()

    def result(self) -> PromptScores:
        def pair(p):
            return TokenLogprobs(p[0].numpy(), p[1].numpy()) if p is not None else None

        return PromptScores(
            prompt_logprobs=tuple(self.logprobs.tolist()) if self.logprobs is not None else None,
            topk_prompt_logprobs=pair(self.top),
            target_prompt_logprobs=self.target.numpy() if self.target is not None else None,
            prompt_alt_tokens=pair(self.alt),
        )


def _alt_uniforms(r: SampleRequest) -> torch.Tensor:
    """(len(prompt) - 1, k) float64 uniforms in [0, 1) of the request's alt draws: a function of its
    seed alone (a seeded request draws the same alternatives in any batch); unseeded: fresh."""
    seed = r.params.seed if r.params.seed is not None else int.from_bytes(os.urandom(8), "little")
    g = torch.Generator().manual_seed(row_seed(seed, ALT_STREAM))
    return torch.rand(len(r.prompt) - 1, r.prompt_alt_tokens_k, generator=g, dtype=torch.float64)


def _draw_alternatives(logp_RV: torch.Tensor, u_Rk: torch.Tensor, temperature: float, model):
    """k draws per row at `temperature` (inverse CDF at the given uniforms; 0: the argmax, smaller
    id on ties), and the model's own logprob of each."""
    if temperature == 0:
        ids = logp_RV.argmax(-1, keepdim=True).expand(-1, u_Rk.shape[1])
    else:
        dist = logp_RV if temperature == 1 else model.log_softmax(logp_RV / temperature)
        cdf = torch.cumsum(torch.exp(dist.double()), dim=-1)
        ids = torch.searchsorted(cdf, u_Rk * cdf[:, -1:], right=True).clamp_(max=logp_RV.shape[-1] - 1)
    return ids, logp_RV.gather(1, ids)
