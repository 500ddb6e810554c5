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

import concurrent.futures
import operator
import queue
import threading
import weakref
from dataclasses import dataclass

import torch

from lockstep.engine.types import EngineError


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
    auto_off_steps: int = 0
    """Decode steps that `auto` ran without drafts (speculation did not pay)."""
    drafter_timeouts: int = 0
    """Drafter calls abandoned past the sampler's draft timeout (also counted in drafter_errors)."""
    invalid_drafts: int = 0
    """Row drafts refused because they held something other than token ids in [0, vocab size)."""

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per row and verify forward."""
        return self.accepted / self.row_verifies if self.row_verifies else 0.0


def draft_block(session, rows: list[int], budgets: list[int], k: int, pad: int,
                vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(drafts (R, k), lengths (R,), refused): each row's proposal, at most its budget, padded with
    `pad`. A proposal holding anything but token ids in [0, vocab_size) is refused whole (the row
    drafts nothing this step) and counted in `refused`: fed to the verify forward, an id past the
    vocabulary would index outside the embedding and fail the whole call, a negative one would
    wrap around to another token's row."""
    out = torch.full((len(rows), k), pad, dtype=torch.long)
    lengths = torch.zeros(len(rows), dtype=torch.long)
    if hasattr(session, "draft"):  # a batched drafter (a model): every row in one call
        proposals = session.draft(rows, budgets, k)
    else:
        proposals = [session.propose(r, min(k, budget)) for r, budget in zip(rows, budgets)]
    refused = 0
    for i, (d, budget) in enumerate(zip(proposals, budgets)):
        ids = token_ids(list(d)[: min(k, budget)], vocab_size)
        if ids is None:
            refused += 1
        elif ids:
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            lengths[i] = len(ids)
    return out, lengths, refused


def token_ids(draft: list, vocab_size: int) -> list[int] | None:
    """The draft as ints, or None if any entry is not an integer id in [0, vocab_size) (a bool or a
    float is a drafter's bug, not an id)."""
    ids = []
    for t in draft:
        if isinstance(t, bool):
            return None
        try:
            t = operator.index(t)  # ints, NumPy and 0-d torch integers; never a float
        except TypeError:
            return None
        if not 0 <= t < vocab_size:
            return None
        ids.append(t)
    return ids


def rollback(cache, positions_R: torch.Tensor, fed_until_R: torch.Tensor) -> None:
    """Zero every layer's cache slots [positions_R[r], fed_until_R[r]) of each row r: the tokens fed
    there were rejected."""
    counts = (fed_until_R - positions_R).clamp(min=0)
    total = int(counts.sum())
    if total == 0:
        return
    rows_t = torch.arange(len(counts)).repeat_interleave(counts)
    starts = torch.cumsum(counts, 0) - counts  # each row's first index in the flat list
    slots_t = positions_R.repeat_interleave(counts) + torch.arange(total) - starts.repeat_interleave(counts)
    for k, v in zip(cache.k, cache.v1):
        k[rows_t, :, slots_t] = 0.0
        v[rows_t, :, slots_t, : k.shape[-1]] = 0.0


class AutoWidth:
    """`auto`: whether to draft this step (width max_width) or not (0, a plain step), from what
    speculation has been measured to cost and to earn on this sampler's request stream.

    Cost: a step feeding n tokens (rows x (1 + width)) takes a + b n seconds (drafting and the
    acceptance included), fitted online by exponentially weighted least squares over the steps seen.
    Earnings: the accepted drafts per live row in a verify step, measured (exponentially weighted):
    no model of how acceptance falls along a draft, nor of drafts that come out short. A step
    drafts when its expected tokens per second beat plain decoding's by `margin`. While speculation
    is off, a probe step drafts anyway, so that a stream whose drafts start to pay turns it back on:
    `probe_every` steps after the last drafting step, then at doubling gaps (up to
    `max_probe_gap`) while probes keep finding that it does not pay."""

    def __init__(self, max_width: int, *, decay: float = 0.9, probe_every: int = 16, max_probe_gap: int = 1024,
                 margin: float = 1.05):
        self.max_width, self.decay, self.probe_every, self.margin = max_width, decay, probe_every, margin
        self.probe_gap, self.max_probe_gap = probe_every, max_probe_gap
        self._sums = [0.0] * 5  # weighted n, n^2, t, n t, weight
        self._gain = [1.0, 1.0]  # weighted accepted drafts, weighted live rows (prior: 1 a row)
        self.since_draft = 0
        self.observed = 0

    @property
    def gain(self) -> float:
        """Accepted drafts per live row and verify step."""
        return self._gain[0] / self._gain[1]

    def cost(self, n: int) -> float | None:
        """Seconds of a step feeding n tokens, or None before two different sizes were seen."""
        sn, snn, st, snt, w = self._sums
        det = w * snn - sn * sn
        if w <= 0 or det <= 1e-9 * max(1.0, snn * w):
            return None
        b = max((w * snt - sn * st) / det, 0.0)  # more tokens never cost less (noise aside)
        a = (st - b * sn) / w
        return max(a + b * n, 1e-9)

    def width(self, fed_rows: int, live_rows: int) -> int:
        """Draft width for a step feeding `fed_rows` rows, `live_rows` of them still sampling."""
        if live_rows <= 0:
            return 0
        if self.cost(fed_rows) is None:  # one size seen so far: measure another, alternating
            self.observed += 1
            return self.max_width if self.observed % 2 else 0
        plain = live_rows / self.cost(fed_rows)
        drafting = live_rows * (1 + self.gain) / self.cost(fed_rows * (1 + self.max_width))
        if drafting > plain * self.margin:
            self.since_draft, self.probe_gap = 0, self.probe_every
            return self.max_width
        self.since_draft += 1
        if self.since_draft >= self.probe_gap:  # a probe; each one that does not pay doubles the gap
            self.since_draft, self.probe_gap = 0, min(2 * self.probe_gap, self.max_probe_gap)
            return self.max_width
        return 0

    def observe_forward(self, fed: int, seconds: float) -> None:
        d = self.decay
        self._sums = [s * d + x for s, x in zip(self._sums, (fed, fed * fed, seconds, fed * seconds, 1.0))]

    def observe_drafts(self, accepted: int, live_rows: int) -> None:
        d = self.decay
        self._gain = [self._gain[0] * d + accepted, self._gain[1] * d + live_rows]


class DrafterTimeout(EngineError):
    pass


MAX_ABANDONED = 4
"""Drafter calls abandoned past their timeout that may still be running in this process, all guards
together (a service builds a sampler, so a guard, per sample call): past it every guard refuses
drafter calls at once until one of them returns, so a drafter hung for good costs at most this many
threads, however many calls time out on it."""

_abandoned: list[threading.Thread] = []
_abandoned_lock = threading.Lock()


def abandoned_threads() -> list[threading.Thread]:
    """The worker threads abandoned past a timeout whose call is still running."""
    with _abandoned_lock:
        _abandoned[:] = [t for t in _abandoned if t.is_alive()]
        return list(_abandoned)


class DraftGuard:
    """Runs drafter calls with a deadline: in a worker thread that the sampler waits on for at most
    `timeout_s`. A call past it raises DrafterTimeout and its worker is abandoned (Python cannot
    stop a thread; it ends when the call returns); the next call gets a fresh worker, so the
    drafter is restarted rather than waited on. Workers are daemon threads, so a drafter hung for
    good never holds up the process's exit, and at most MAX_ABANDONED abandoned ones run at once
    (past that, calls raise DrafterTimeout at once and the sampler decodes plainly). timeout_s
    None: calls run inline."""

    def __init__(self, timeout_s: float | None):
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise EngineError(f"draft_timeout must be a positive number of seconds or None, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._worker: _Worker | None = None

    def call(self, fn):
        if self.timeout_s is None:
            return fn()
        if self._worker is None:
            running = len(abandoned_threads())
            if running >= MAX_ABANDONED:
                raise DrafterTimeout(f"{running} drafter calls are still running past their timeout; drafting "
                                     "resumes once one of them returns")
            self._worker = _Worker()
        future = self._worker.submit(_in_inference_mode, fn)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            with _abandoned_lock:
                _abandoned.append(self._worker.stop())
            self._worker = None
            raise DrafterTimeout(f"the drafter did not answer within {self.timeout_s} s") from None

    def close(self) -> None:
        """Stop the current worker and join it (it is idle between calls, so this returns at once)."""
        if self._worker is not None:
            self._worker.stop().join()
            self._worker = None


class _Worker:
    """One daemon thread running submitted calls in order. Written here rather than using a
    ThreadPoolExecutor: the executor's threads are not daemons and its exit hook joins them, so a
    drafter call that never returns would keep the process from ever exiting."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=_serve, args=(self._jobs,), name="drafter", daemon=True)
        self.thread.start()
        weakref.finalize(self, self._jobs.put, None)  # a dropped guard's idle worker ends too

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return future

    def stop(self) -> threading.Thread:
        """Let the thread end after the call it is running (if any); returns the thread."""
        self._jobs.put(None)
        return self.thread


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        future, fn, args = job
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(e)
        del job, future, fn, args  # hold nothing of a finished call while waiting for the next


def _in_inference_mode(fn):
    with torch.inference_mode():  # as the sampler's own thread: the drafter's tensors are alike
        return fn()


class DraftLink:
    """One sample() call's tie to its drafter session. Emitted tokens are queued here and handed to
    the session together with the next draft request, so that each decode step makes one guarded
    call, not two."""

    def __init__(self, session, guard: DraftGuard):
        self.session, self.guard = session, guard
        self._pending: list[tuple[list[int], list[list[int]]]] = []

    def feed(self, rows: list[int], runs: list[list[int]]) -> None:
        self._pending.append((rows, runs))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for rows, runs in pending:
            for row, run in zip(rows, runs):
                self.session.append(row, run)

    def draft(self, rows: list[int], budgets: list[int], k: int, vocab_size: int,
              pad: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        def go():
            self._flush()
            return draft_block(self.session, rows, budgets, k, pad, vocab_size)

        return self.guard.call(go)

    def finish(self) -> None:
        def go():
            self._flush()
            self.session.finish()

        self.guard.call(go)
