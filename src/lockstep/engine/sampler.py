"""Batched decoding with a KV cache over the invariant forward.

Per call: validate, prefill each distinct prompt once (right-padded batch), copy each prompt's
cache rows to its samples, then decode all rows in lockstep. Finished rows are dropped from the
batch once they are half of it; the forward is batch-invariant, so compaction never changes a
logprob. With a drafter, each step verifies drafted tokens in the same forward
(engine/speculative.py); what is sampled does not change. Requests may name different LoRA
adapters of a shared base (SampleRequest.adapter): every forward then applies each row's own
(engine/multi_lora.py), and each row's tokens and logprobs are those it gets alone.
"""

from __future__ import annotations

import logging
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from lockstep.engine import speculative as spec
from lockstep.engine.model import InvariantLM, KVCache
from lockstep.engine.sampling import RowParams, choose_scored, row_seed
from lockstep.engine.scores import PromptScores, score_prompt, top_k
from lockstep.engine.types import (AdapterAssignment, EngineError, SampledSequence, SampleRequest, SampleResult,
                                   TokenLogprobs)

log = logging.getLogger(__name__)


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
    lora: "_RowAdapters | None" = None  # each row's adapter, None when no request names one

    def select(self, keep: torch.Tensor) -> "_Rows":
        lora = self.lora.select(keep) if self.lora is not None else None
        return _Rows(self.ids[keep], self.params.select(keep), self.positions[keep], self.cache.select(keep), lora)

    def adapters(self) -> AdapterAssignment | None:
        return self.lora.assignment() if self.lora is not None else None


@dataclass
class _RowAdapters:
    """The call's distinct adapters and each row's index into them (-1: the bare base)."""

    adapters: tuple
    index: torch.Tensor

    @staticmethod
    def of(requests) -> "_RowAdapters | None":
        """One entry per request (the prefill's rows), or None when no request names an adapter."""
        slots: dict[int, int] = {}
        distinct = []
        for r in requests:
            if r.adapter is not None and id(r.adapter) not in slots:
                slots[id(r.adapter)] = len(distinct)
                distinct.append(r.adapter)
        if not distinct:
            return None
        return _RowAdapters(tuple(distinct), torch.tensor([slots[id(r.adapter)] if r.adapter is not None else -1
                                                           for r in requests], dtype=torch.long))

    def select(self, keep: torch.Tensor) -> "_RowAdapters":
        return _RowAdapters(self.adapters, self.index[keep])

    def assignment(self) -> AdapterAssignment:
        return AdapterAssignment(self.adapters, tuple(self.index.tolist()))


class _Tape:
    """Per-sample outputs (flat over all samples of all requests), written one token at a time per
    row at the row's own index, and the stop rules that end a row."""

    def __init__(self, sampler: "Sampler", requests, owner):
        S = len(owner)
        self.sampler = sampler
        self.stop_ids = sampler._stop_id_table(requests, owner)
        self.stop_strs = [sampler._stop_strings(requests[i]) for i in owner]
        self.any_str = any(self.stop_strs)
        self.max_new = torch.tensor([requests[i].params.max_tokens for i in owner])
        steps = int(self.max_new.max())
        self.tokens = torch.zeros(S, steps, dtype=torch.long)
        self.logprobs = torch.zeros(S, steps, dtype=torch.float32)
        self.versions = torch.zeros(S, steps, dtype=torch.long)
        self.n_out = torch.zeros(S, dtype=torch.long)
        self.stopped = torch.zeros(S, dtype=torch.bool)
        widths = [requests[i].topk_sample_logprobs for i in owner]
        self.top = _TopTape(widths, self.max_new.tolist()) if any(widths) else None

    def record(self, ids: torch.Tensor, tokens: torch.Tensor, lps: torch.Tensor, version: int,
               model_logp: torch.Tensor) -> torch.Tensor:
        """Append one token to each of the samples `ids` (model_logp: the model's log-softmax row
        each was drawn from); returns which of them have now ended."""
        at = self.n_out[ids]
        if self.top is not None:
            self.top.record(ids, at, model_logp)
        self.tokens[ids, at] = tokens
        self.logprobs[ids, at] = lps
        self.versions[ids, at] = version
        self.n_out[ids] = at + 1
        stopped = (self.stop_ids[ids] == tokens.unsqueeze(1)).any(1)
        if self.any_str:
            stopped |= self.sampler._string_stops(ids.tolist(), self.tokens, self.n_out, self.stop_strs)
        self.stopped[ids] = stopped
        return stopped | (at + 1 >= self.max_new[ids])

    def record_runs(self, ids: torch.Tensor, tokens: torch.Tensor, lps: torch.Tensor, counts: torch.Tensor,
                    version: int, model_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append tokens[r, :counts[r]] to sample ids[r], each run cut after its first stop token
        (stop ids only: no stop strings); returns (tokens appended, which rows have now ended).
        model_logp (R, k, V): the log-softmax row each token was drawn from."""
        k = tokens.shape[1]
        within = torch.arange(k) < counts.unsqueeze(1)
        stop = (self.stop_ids[ids].unsqueeze(1) == tokens.unsqueeze(2)).any(2) & within
        counts = torch.where(stop.any(1), stop.long().argmax(1) + 1, counts)  # up to and with the first stop
        keep = torch.arange(k) < counts.unsqueeze(1)
        r, c = keep.nonzero(as_tuple=True)
        at = self.n_out[ids][r] + c
        if self.top is not None:
            self.top.record(ids[r], at, model_logp[r, c])
        self.tokens[ids[r], at] = tokens[r, c]
        self.logprobs[ids[r], at] = lps[r, c]
        self.versions[ids[r], at] = version
        self.n_out[ids] += counts
        stopped = stop.any(1)
        self.stopped[ids[stopped]] = True
        return counts, (counts > 0) & (stopped | (self.n_out[ids] >= self.max_new[ids]))

    def tokens_of(self, j: int) -> list[int]:
        return self.tokens[j, : int(self.n_out[j])].tolist()

    def outputs(self) -> "_Out":
        lengths = self.n_out.tolist()
        return _Out(
            tokens=[self.tokens[j, :n].tolist() for j, n in enumerate(lengths)],
            logprobs=[self.logprobs[j, :n].tolist() for j, n in enumerate(lengths)],
            versions=[self.versions[j, :n].tolist() for j, n in enumerate(lengths)],
            reason=["stop" if s else "length" for s in self.stopped.tolist()],
            top=[self.top.of(j, n) if self.top is not None else None for j, n in enumerate(lengths)],
        )


class _TopTape:
    """The top-k of each sampled token, for the samples whose request asked (topk_sample_logprobs):
    one flat buffer holding sample j's (max_new_j, k_j) block at its own offset, so the memory is
    what each request asked for, never the batch's widest k times its longest completion."""

    def __init__(self, widths: list[int], max_new: list[int]):
        self.k = torch.tensor(widths, dtype=torch.long)
        sizes = torch.tensor([w * m for w, m in zip(widths, max_new)], dtype=torch.long)
        self.offset = torch.cumsum(sizes, 0) - sizes
        total = int(sizes.sum())
        self.ids = torch.full((total,), -1, dtype=torch.long)
        self.lps = torch.full((total,), math.nan)

    def record(self, ids: torch.Tensor, at: torch.Tensor, model_logp: torch.Tensor) -> None:
        """Sample ids[r]'s token number at[r] was drawn from model_logp[r] (the model's log-softmax)."""
        k = self.k[ids]
        sel = (k > 0).nonzero().squeeze(1)
        if sel.numel() == 0:
            return
        k = k[sel]
        width = int(k.max())
        top_ids, top_lps = top_k(model_logp[sel.to(model_logp.device)], width)  # each row's first k_j: its own top-k_j
        col = torch.arange(width)
        valid = col < k.unsqueeze(1)
        flat = self.offset[ids[sel]].unsqueeze(1) + at[sel].unsqueeze(1) * k.unsqueeze(1) + col
        self.ids[flat[valid]] = top_ids.cpu()[valid]
        self.lps[flat[valid]] = top_lps.float().cpu()[valid]

    def of(self, j: int, n: int) -> TokenLogprobs | None:
        k = int(self.k[j])
        if k == 0:
            return None
        start = int(self.offset[j])
        return TokenLogprobs(self.ids[start : start + n * k].view(n, k).numpy(),
                             self.lps[start : start + n * k].view(n, k).numpy())


@dataclass
class _Out:
    """Per-sample outputs (flat over all samples of all requests)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    reason: list[str]
    top: list[TokenLogprobs | None]


class Sampler:
    """Samples from an `InvariantLM`; reported logprobs equal the trainer's bit for bit."""

    def __init__(self, model: InvariantLM, tokenizer, *, policy_version: int = 0, drafter=None, draft_tokens: int = 4,
                 auto: "bool | spec.AutoWidth" = False, draft_timeout: float | None = None):
        """drafter: None (plain decoding) or a drafter (engine/drafters.py) whose proposals, up to
        `draft_tokens` per row and step, are verified in the decode step's forward. auto: choose the
        width each step from measured cost and acceptance (speculative.AutoWidth), down to none;
        an AutoWidth carries on with its measurements (one request stream over several samplers).
        draft_timeout: seconds a drafter call may take before the call decodes on without it (its
        calls then run in a worker thread, ~50 us a step); None: calls run inline, unbounded."""
        if drafter is not None and not (isinstance(draft_tokens, int) and draft_tokens >= 1):
            raise EngineError(f"draft_tokens must be an integer >= 1, got {draft_tokens!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.eos_id = tokenizer.eos_token_id
        self.policy_version = policy_version
        self.drafter = drafter
        self.draft_tokens = draft_tokens
        self.spec_stats = spec.SpecStats()
        self.draft_guard = spec.DraftGuard(draft_timeout)
        if isinstance(auto, spec.AutoWidth):
            self.auto = auto if drafter is not None else None
        else:
            self.auto = spec.AutoWidth(draft_tokens) if drafter is not None and auto else None

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
        self.check(requests)
        with self.model.compute.scope():  # on a GPU, the decode state lives there too
            return self._sample(requests, between_steps)

    def check(self, requests: Sequence[SampleRequest]) -> None:
        """EngineError naming what `sample(requests)` would refuse, before any compute: a caller
        packing several clients' requests checks each alone, so that one cannot fail the others."""
        for i, r in enumerate(requests):
            check_tokens(r.prompt, self.vocab_size, f"request {i} prompt")
            self._check_stops(r, i)
            self._check_extras(r, i)
            if r.adapter is not None:
                self.model.check_adapter(r.adapter, f"request {i} adapter")

    def _sample(self, requests, between_steps) -> list[SampleResult]:
        lora = _RowAdapters.of(requests)
        first_logits, scores, cache = self._prefill(requests, lora)
        owner = [i for i, r in enumerate(requests) for _ in range(r.num_samples)]
        rows = self._init_rows(requests, owner, cache, lora)
        logits = first_logits.index_select(0, torch.tensor(owner))
        out = self._decode(requests, owner, rows, logits, between_steps)
        return self._results(requests, owner, out, scores)

    # -- phases ------------------------------------------------------------------------------
    def _check_stops(self, r: SampleRequest, i: int) -> None:
        ids = [s for s in (r.params.stop or ()) if isinstance(s, int)]
        check_tokens(ids, self.vocab_size, f"request {i} stop")

    def _check_extras(self, r: SampleRequest, i: int) -> None:
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
            if getattr(r, name) > self.vocab_size:
                raise EngineError(f"request {i} {name}={getattr(r, name)} exceeds the vocabulary ({self.vocab_size})")
        if r.target_prompt_ids is not None and int(r.target_prompt_ids.max()) >= self.vocab_size:
            raise EngineError(f"request {i} target_prompt_ids holds token ids outside the vocabulary "
                              f"[0, {self.vocab_size}) (-1 means none)")

    def _prefill(self, requests, lora: _RowAdapters | None) -> tuple[torch.Tensor, list, KVCache]:
        """Run each prompt once; return last-position logits (P, V), each request's PromptScores
        (engine/scores.py: read from this forward's rows), cache."""
        P = len(requests)
        lens = [len(r.prompt) for r in requests]
        T = max(lens)
        capacity = max(len(r.prompt) + r.params.max_tokens for r in requests) + self._draft_room()
        tokens = torch.zeros(P, T, dtype=torch.long)
        for i, r in enumerate(requests):
            tokens[i, : lens[i]] = torch.tensor(r.prompt)
        cache = self.model.new_cache(P, capacity)
        assignment = lora.assignment() if lora else None
        hidden = self._hidden(tokens, torch.arange(T).expand(P, T), cache, assignment)
        last = hidden[torch.arange(P), torch.tensor(lens) - 1]
        logits = self.model.logits(last, assignment)  # each row's lm_head adapter too: the trainer's logits
        scores = [PromptScores()] * P
        for i, r in enumerate(requests):  # one request at a time: its scores hold a few of its rows x V at once
            if r.scores_prompt:
                sub = lora.select(torch.tensor([i])).assignment() if lora else None
                scores[i] = score_prompt(self.model, hidden[i : i + 1, : lens[i]], r, sub)
        return logits, scores, cache

    def _init_rows(self, requests, owner, cache, lora: _RowAdapters | None) -> _Rows:
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
        return _Rows(torch.arange(len(owner)), params, positions, cache.select(idx),
                     lora.select(idx) if lora is not None else None)

    def close(self) -> None:
        """Stop the drafter's worker thread (a sampler dropped without this stops it when collected)."""
        self.draft_guard.close()

    def speculation_stats(self) -> dict:
        """SpecStats' counters, and a learning drafter's own (draft version, the policy version it
        learned from, its training steps)."""
        own = getattr(self.drafter, "stats", None)
        return {**dataclasses.asdict(self.spec_stats), **(own() if callable(own) else {})}

    def _hidden(self, tokens, positions, cache: KVCache, adapters: AdapterAssignment | None) -> torch.Tensor:
        """The forward over the cache, each row with its adapter when a request names one."""
        if adapters is None:
            return self.model.hidden_states(tokens, positions, cache)
        return self.model.hidden_states(tokens, positions, cache, adapters=adapters)

    def _draft_room(self) -> int:
        """Cache slots past a completion's last token that a verify forward may write to."""
        return self.draft_tokens if self.drafter is not None else 0

    def _decode(self, requests, owner, rows: _Rows, logits, between_steps) -> _Out:
        tape = _Tape(self, requests, owner)
        link = self._draft_link(requests, owner, rows.cache.capacity)
        alive = torch.ones(len(owner), dtype=torch.bool)
        while True:
            # Every live row draws its next token from `logits` at its own token index.
            tokens, lps, model_logp = choose_scored(logits, rows.params, tape.n_out[rows.ids], self.model.ops)
            ids = rows.ids[alive]
            ended = tape.record(ids, tokens[alive], lps[alive], self.policy_version, model_logp[alive])
            if link is not None:
                link.feed(ids.tolist(), tokens[alive].unsqueeze(1).tolist())
            alive[alive.clone()] = ~ended
            if not bool(alive.any()):
                break
            if int(alive.sum()) <= alive.numel() // 2:
                keep = alive.nonzero().squeeze(1)
                rows, tokens, alive = rows.select(keep), tokens[keep], alive[keep]
            if between_steps is not None and between_steps():
                logits = self._reprefill(rows, [requests[owner[j]].prompt for j in rows.ids.tolist()], tape)
                continue
            drafts = lengths = None
            width = self.draft_tokens if self.auto is None else self.auto.width(len(alive), int(alive.sum()))
            self.spec_stats.auto_off_steps += self.auto is not None and width == 0
            started = time.perf_counter()
            if link is not None and width > 0:
                drafts, lengths, link = self._drafts(link, rows, alive, tape, width)
            if drafts is None:  # plain decoding: feed the token, get the next logits
                hidden = self._hidden(tokens.unsqueeze(1), rows.positions.unsqueeze(1), rows.cache, rows.adapters())
                rows.positions = rows.positions + alive.long()  # finished rows stay put (bounded cache)
                logits = self.model.logits(hidden[:, 0], rows.adapters())
            else:
                logits = self._verify(rows, alive, tokens, drafts, lengths, tape, link)
            if self.auto is not None:  # the whole step: drafting, the forward and the acceptance
                fed = len(alive) * (1 if drafts is None else 1 + drafts.shape[1])
                self.auto.observe_forward(fed, time.perf_counter() - started)
        if link is not None:
            try:
                link.finish()
            except Exception as e:  # noqa: BLE001 - only the drafter's memory of this call is lost
                self._drafter_failed(e)
        if self.drafter is not None and link is None:
            self.spec_stats.plain_fallbacks += 1
        return tape.outputs()

    # -- speculation -------------------------------------------------------------------------
    def _draft_link(self, requests, owner, capacity: int) -> "spec.DraftLink | None":
        if self.drafter is None:
            return None
        prompts = [requests[i].prompt for i in owner]
        try:
            session = self.draft_guard.call(lambda: self.drafter.session(prompts, capacity=capacity,
                                                                         policy_version=self.policy_version))
            return spec.DraftLink(session, self.draft_guard)
        except Exception as e:  # noqa: BLE001 - a drafter never fails a rollout: decode plainly
            self._drafter_failed(e)
            return None

    def _drafter_failed(self, error: Exception) -> None:
        st = self.spec_stats
        st.drafter_errors += 1
        st.drafter_timeouts += isinstance(error, spec.DrafterTimeout)
        log.warning("the drafter failed (%d so far); this call decodes without speculation: %s", st.drafter_errors,
                    error, exc_info=not isinstance(error, spec.DrafterTimeout))

    def _refused_drafts(self, count: int) -> None:
        st = self.spec_stats
        if not st.invalid_drafts:  # once per sampler: a broken drafter would otherwise log every step
            log.warning("the drafter proposed token ids outside the vocabulary [0, %d): such drafts are dropped "
                        "(counted in invalid_drafts)", self.vocab_size)
        st.invalid_drafts += count

    def _drafts(self, link: "spec.DraftLink", rows: _Rows, alive, tape: _Tape, width: int):
        """(drafts (R, k), lengths (R,), link): each live row's proposal, up to `width` tokens and
        what it may still emit; drafts None when no row has any (then this step is a plain one),
        link None when the drafter failed (plain decoding for the rest of the call)."""
        started = time.perf_counter()
        ids = rows.ids.tolist()
        budgets = (tape.max_new[rows.ids] - tape.n_out[rows.ids]).clamp(min=0) * alive
        try:
            drafts, lengths, refused = link.draft(ids, budgets.tolist(), width, self.vocab_size)
        except Exception as e:  # noqa: BLE001
            self._drafter_failed(e)
            return None, None, None
        if refused:
            self._refused_drafts(refused)
        self.spec_stats.draft_seconds += time.perf_counter() - started
        width = int(lengths.max()) if lengths.numel() else 0
        if width == 0:
            return None, None, link
        return drafts[:, :width], lengths, link

    def _verify(self, rows: _Rows, alive, tokens, drafts, lengths, tape: _Tape, link) -> torch.Tensor:
        """Feed each row's token and its drafts in one forward; emit the drafts that the row's own
        samples confirm (engine/speculative.py); return the logits for each row's next token."""
        started = time.perf_counter()
        R, k = drafts.shape
        feed = torch.cat([tokens.unsqueeze(1), drafts], dim=1)
        offsets = torch.arange(k + 1).unsqueeze(0) * alive.long().unsqueeze(1)  # finished rows stay put
        positions = rows.positions.unsqueeze(1) + offsets
        adapters = rows.adapters()
        all_logits = self.model.logits(self._hidden(feed, positions, rows.cache, adapters), adapters)  # (R, k+1, V)
        steps = tape.n_out[rows.ids].unsqueeze(1) + torch.arange(k)
        picks = rows.params.select(torch.arange(R).repeat_interleave(k))
        samples, lps, model_logp = choose_scored(all_logits[:, :k].reshape(R * k, -1), picks, steps.reshape(-1),
                                                 self.model.ops)
        samples, lps, model_logp = samples.view(R, k), lps.view(R, k), model_logp.view(R, k, -1)
        was_alive = alive.clone()
        agree = (samples == drafts) & (torch.arange(k) < lengths.unsqueeze(1)) & alive.unsqueeze(1)
        run = agree.long().cumprod(dim=1).sum(dim=1)  # each row's run of confirmed drafts
        if tape.any_str:  # stop strings need the decoded text after each token
            accepted = self._emit_by_column(rows, alive, drafts, lps, model_logp, run, tape, link)
        else:
            accepted, ended = tape.record_runs(rows.ids, drafts, lps, run, self.policy_version, model_logp)
            alive[ended] = False
            took = (accepted > 0).nonzero().squeeze(1).tolist()
            link.feed(rows.ids[took].tolist(), [drafts[r, : int(accepted[r])].tolist() for r in took])
        fed_until = rows.positions + (k + 1) * was_alive.long()
        rows.positions = rows.positions + (1 + accepted) * was_alive.long()
        spec.rollback(rows.cache, rows.positions, fed_until)  # the rejected tokens' slots
        if self.auto is not None:
            self.auto.observe_drafts(int(accepted.sum()), int(was_alive.sum()))
        st = self.spec_stats
        st.verify_steps += 1
        st.row_verifies += int((lengths > 0).sum())
        st.drafted += int(lengths.sum())
        st.accepted += int(accepted.sum())
        st.verify_seconds += time.perf_counter() - started
        return all_logits[torch.arange(R), accepted]

    def _emit_by_column(self, rows: _Rows, alive, drafts, lps, model_logp, run, tape: _Tape, link) -> torch.Tensor:
        """Emit each row's confirmed drafts one column at a time (a stop string ends a run)."""
        accepted = torch.zeros_like(run)
        for i in range(int(run.max()) if run.numel() else 0):
            at = ((run > i) & alive).nonzero().squeeze(1)
            if at.numel() == 0:
                break
            ended = tape.record(rows.ids[at], drafts[at, i], lps[at, i], self.policy_version, model_logp[at, i])
            link.feed(rows.ids[at].tolist(), drafts[at, i].unsqueeze(1).tolist())
            accepted[at] += 1
            alive[at[ended]] = False
        return accepted

    def _reprefill(self, rows: _Rows, prompts, tape: _Tape) -> torch.Tensor:
        """After a weight swap, rebuild the rows' caches under the new weights.

        Every row's prompt and tokens so far are prefilled afresh, so the next token's logprob is
        exactly the new version's given the whole prefix (the trainer's recomputation agrees).
        """
        seqs = [list(p) + tape.tokens_of(j) for p, j in zip(prompts, rows.ids.tolist())]
        lens = torch.tensor([len(x) for x in seqs])
        T = int(lens.max())
        tokens = torch.zeros(len(seqs), T, dtype=torch.long)
        for i, x in enumerate(seqs):
            tokens[i, : len(x)] = torch.tensor(x)
        rows.cache = self.model.new_cache(len(seqs), rows.cache.capacity)
        hidden = self._hidden(tokens, torch.arange(T).expand(len(seqs), T), rows.cache, rows.adapters())
        rows.positions = lens
        return self.model.logits(hidden[torch.arange(len(seqs)), lens - 1], rows.adapters())

    def _results(self, requests, owner, out: _Out, scores: list[PromptScores]) -> list[SampleResult]:
        seqs: list[list[SampledSequence]] = [[] for _ in requests]
        for j, i in enumerate(owner):
            seqs[i].append(
                SampledSequence(
                    tokens=tuple(out.tokens[j]),
                    logprobs=tuple(out.logprobs[j]),
                    stop_reason=out.reason[j],
                    policy_version=min(out.versions[j]),
                    token_versions=tuple(out.versions[j]),
                    topk_logprobs=out.top[j],
                )
            )
        return [SampleResult(tuple(s), sc.prompt_logprobs, topk_prompt_logprobs=sc.topk_prompt_logprobs,
                             target_prompt_logprobs=sc.target_prompt_logprobs, prompt_alt_tokens=sc.prompt_alt_tokens)
                for s, sc in zip(seqs, scores)]

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
