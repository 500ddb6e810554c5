"""Batched decoding with a KV cache over the invariant forward.

Per call: validate, prefill each distinct prompt once (right-padded batch), copy each prompt's
cache rows to its samples, then decode all rows in lockstep. Finished rows are dropped from the
batch once they are half of it; the forward is batch-invariant, so compaction never changes a
logprob.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from lockstep.engine.model import InvariantLM, KVCache
from lockstep.engine.sampling import RowParams, choose, row_seed
from lockstep.engine.types import EngineError, SampledSequence, SampleRequest, SampleResult


def check_tokens(tokens: Sequence[int], vocab_size: int, what: str) -> None:
    bad = [t for t in tokens if not (0 <= int(t) < vocab_size)]
    if bad:
        raise EngineError(f"{what} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


@dataclass
class _Rows:
    """Decode state of the rows still in the batch."""

    ids: torch.Tensor  # index into the flat list of samples
    params: RowParams
    positions: torch.Tensor  # position of the next token to feed, per row
    cache: KVCache

    def select(self, keep: torch.Tensor) -> "_Rows":
        return _Rows(self.ids[keep], self.params.select(keep), self.positions[keep], self.cache.select(keep))


@dataclass
class _Out:
    """Per-sample outputs (flat over all samples of all requests)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    reason: list[str]


class Sampler:
    """Samples from an `InvariantLM`; reported logprobs equal the trainer's bit for bit."""

    def __init__(self, model: InvariantLM, tokenizer, *, policy_version: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.eos_id = tokenizer.eos_token_id
        self.policy_version = policy_version

    # -- public ------------------------------------------------------------------------------
    @torch.inference_mode()
    def sample(
        self,
        requests: Sequence[SampleRequest],
        *,
        between_steps: Callable[[], bool] | None = None,
    ) -> list[SampleResult]:
        """Sample every request.

        `between_steps` runs between decode steps; it returns True when it has swapped the
        weights (and set `policy_version`), and the sampler then re-prefills its active rows.
        """
        if not requests:
            return []
        for i, r in enumerate(requests):
            check_tokens(r.prompt, self.vocab_size, f"request {i} prompt")
            self._check_stops(r, i)
        first_logits, prompt_lps, cache = self._prefill(requests)
        owner = [i for i, r in enumerate(requests) for _ in range(r.num_samples)]
        rows = self._init_rows(requests, owner, cache)
        logits = first_logits.index_select(0, torch.tensor(owner))
        out = self._decode(requests, owner, rows, logits, between_steps)
        return self._results(requests, owner, out, prompt_lps)

    # -- phases ------------------------------------------------------------------------------
    def _check_stops(self, r: SampleRequest, i: int) -> None:
        ids = [s for s in (r.params.stop or ()) if isinstance(s, int)]
        check_tokens(ids, self.vocab_size, f"request {i} stop")

    def _prefill(self, requests) -> tuple[torch.Tensor, list, KVCache]:
        """Run each prompt once; return last-position logits (P, V), prompt logprobs, cache."""
        P = len(requests)
        lens = [len(r.prompt) for r in requests]
        T = max(lens)
        capacity = max(len(r.prompt) + r.params.max_tokens for r in requests)
        tokens = torch.zeros(P, T, dtype=torch.long)
        for i, r in enumerate(requests):
            tokens[i, : lens[i]] = torch.tensor(r.prompt)
        cache = self.model.new_cache(P, capacity)
        hidden = self.model.hidden_states(tokens, torch.arange(T).expand(P, T), cache)
        last = hidden[torch.arange(P), torch.tensor(lens) - 1]
        logits = self.model.logits(last)
        prompt_lps: list = [None] * P
        want = [i for i, r in enumerate(requests) if r.prompt_logprobs]
        if want and T > 1:
            lp = self.model.logprobs_of(hidden[want, :-1], tokens[want, 1:])
            for j, i in enumerate(want):
                prompt_lps[i] = (math.nan, *lp[j, : lens[i] - 1].tolist())
        for i in want:
            prompt_lps[i] = prompt_lps[i] or (math.nan,)
        return logits, prompt_lps, cache

    def _init_rows(self, requests, owner, cache) -> _Rows:
        temps, topk, topp, seeds, counters = [], [], [], [], {}
        for i in owner:
            p = requests[i].params
            k = counters[i] = counters.get(i, -1) + 1
            base = p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little")
            temps.append(p.temperature)
            topk.append(p.top_k)
            topp.append(p.top_p)
            seeds.append(row_seed(base, k))
        params = RowParams(
            torch.tensor(temps, dtype=torch.float32),
            torch.tensor(topk, dtype=torch.int64),
            torch.tensor(topp, dtype=torch.float32),
            torch.tensor(seeds, dtype=torch.int64),
        )
        idx = torch.tensor(owner)
        positions = torch.tensor([len(requests[i].prompt) for i in owner])
        return _Rows(torch.arange(len(owner)), params, positions, cache.select(idx))

    def _decode(self, requests, owner, rows: _Rows, logits, between_steps) -> _Out:
        S = len(owner)
        stop_ids = self._stop_id_table(requests, owner)
        stop_strs = [self._stop_strings(requests[i]) for i in owner]
        any_str = any(stop_strs)
        max_new = torch.tensor([requests[i].params.max_tokens for i in owner])
        steps = int(max_new.max())
        tok_buf = torch.zeros(S, steps, dtype=torch.long)
        lp_buf = torch.zeros(S, steps, dtype=torch.float32)
        ver_buf = torch.zeros(S, steps, dtype=torch.long)
        n_out = torch.zeros(S, dtype=torch.long)
        stopped_all = torch.zeros(S, dtype=torch.bool)
        alive = torch.ones(S, dtype=torch.bool)
        step = 0  # every row starts together, so this is each row's token index (its RNG counter)
        while True:
            tokens, lps = choose(logits, rows.params, step)
            ids = rows.ids[alive]
            tok_live = tokens[alive]
            tok_buf[ids, step] = tok_live
            lp_buf[ids, step] = lps[alive]
            ver_buf[ids, step] = self.policy_version
            n_out[ids] = step + 1
            stopped = (stop_ids[ids] == tok_live.unsqueeze(1)).any(1)
            if any_str:
                stopped |= self._string_stops(ids.tolist(), tok_buf, n_out, stop_strs)
            stopped_all[ids] = stopped
            ended = stopped | (step + 1 >= max_new[ids])
            alive[alive.clone()] = ~ended
            if not bool(alive.any()):
                break
            step += 1
            if int(alive.sum()) <= alive.numel() // 2:
                keep = alive.nonzero().squeeze(1)
                rows, tokens, alive = rows.select(keep), tokens[keep], alive[keep]
            if between_steps is not None and between_steps():
                logits = self._reprefill(rows, [requests[owner[j]].prompt for j in rows.ids.tolist()], tok_buf, n_out)
                continue
            hidden = self.model.hidden_states(tokens.unsqueeze(1), rows.positions.unsqueeze(1), rows.cache)
            rows.positions = rows.positions + alive.long()  # finished rows stay put (bounded cache)
            logits = self.model.logits(hidden[:, 0])
        lengths = n_out.tolist()
        return _Out(
            tokens=[tok_buf[j, :n].tolist() for j, n in enumerate(lengths)],
            logprobs=[lp_buf[j, :n].tolist() for j, n in enumerate(lengths)],
            versions=[ver_buf[j, :n].tolist() for j, n in enumerate(lengths)],
            reason=["stop" if s else "length" for s in stopped_all.tolist()],
        )

    def _reprefill(self, rows: _Rows, prompts, tok_buf, n_out) -> torch.Tensor:
        """After a weight swap, rebuild the rows' caches under the new weights.

        Every row's prompt and tokens so far are prefilled afresh, so the next token's logprob is
        exactly the new version's given the whole prefix (the trainer's recomputation agrees).
        """
        seqs = [list(p) + tok_buf[j, : int(n_out[j])].tolist() for p, j in zip(prompts, rows.ids.tolist())]
        lens = torch.tensor([len(x) for x in seqs])
        T = int(lens.max())
        tokens = torch.zeros(len(seqs), T, dtype=torch.long)
        for i, x in enumerate(seqs):
            tokens[i, : len(x)] = torch.tensor(x)
        rows.cache = self.model.new_cache(len(seqs), rows.cache.capacity)
        hidden = self.model.hidden_states(tokens, torch.arange(T).expand(len(seqs), T), rows.cache)
        rows.positions = lens
        return self.model.logits(hidden[torch.arange(len(seqs)), lens - 1])

    def _results(self, requests, owner, out: _Out, prompt_lps) -> list[SampleResult]:
        seqs: list[list[SampledSequence]] = [[] for _ in requests]
        for j, i in enumerate(owner):
            seqs[i].append(
                SampledSequence(
                    tokens=tuple(out.tokens[j]),
                    logprobs=tuple(out.logprobs[j]),
                    stop_reason=out.reason[j],
                    policy_version=min(out.versions[j]),
                    token_versions=tuple(out.versions[j]),
                )
            )
        return [SampleResult(tuple(s), prompt_lps[i]) for i, s in enumerate(seqs)]

    # -- stops -------------------------------------------------------------------------------
    def _stop_id_table(self, requests, owner) -> torch.Tensor:
        """(num_samples, S) stop token ids per sample, padded with -1."""
        per = []
        for i in owner:
            stop = requests[i].params.stop
            ids = [s for s in (stop or ()) if isinstance(s, int)]
            if stop is None or len(stop) > 0:  # stop=() disables EOS too (Tinker semantics)
                ids.append(self.eos_id)
            per.append(ids)
        width = max(1, max(len(p) for p in per))
        return torch.tensor([p + [-1] * (width - len(p)) for p in per], dtype=torch.long)

    @staticmethod
    def _stop_strings(r: SampleRequest) -> tuple[str, ...]:
        return tuple(s for s in (r.params.stop or ()) if isinstance(s, str))

    def _string_stops(self, ids: list[int], tok_buf, n_out, stop_strs) -> torch.Tensor:
        hit = torch.zeros(len(ids), dtype=torch.bool)
        for n, j in enumerate(ids):
            if not stop_strs[j]:
                continue
            window = max(len(s) for s in stop_strs[j]) + 2
            end = int(n_out[j])
            tail = self.tokenizer.decode(tok_buf[j, max(0, end - window) : end].tolist())
            hit[n] = any(s in tail for s in stop_strs[j])
        return hit
