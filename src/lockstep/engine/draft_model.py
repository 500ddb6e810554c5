"""The model drafter: a small causal LM over the target's tokenizer that drafts greedily over its own
KV cache, and keeps learning from the generator's own outputs while the policy changes.

The draft starts as the target's first `layers` decoder layers under the target's embeddings,
final norm and LM head (an early exit of the target: a useful draft before any training). A
trainer thread distils the generator's finished samples into it (next-token cross-entropy on the
sampled completions, so it learns what the current policy writes) and publishes new weights; the
drafter swaps them in between decode steps, with no pause, and records the draft version it used.
The embeddings and LM head are shared with the target and frozen (EAGLE's choice: they are most
of a small model's weights, and a real model's vocabulary makes a copy costly); the decoder
layers and the final norm learn.

What the draft proposes only decides how many drafts the target accepts: a stale or bad draft
costs speed, never a sampled token nor a logprob (engine/speculative.py).
"""

from __future__ import annotations

import copy
import logging
import random
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from lockstep.engine.model import InvariantLM, _base
from lockstep.engine.types import EngineError

log = logging.getLogger(__name__)

_SHARED = ("model.embed_tokens.weight", "lm_head.weight")
"""Draft parameters taken from the target and never trained."""


def _draft_config(target: InvariantLM, layers: int):
    cfg = copy.deepcopy(target.config)
    if layers > cfg.num_hidden_layers:
        raise EngineError(f"model drafter: layers must be at most the target's {cfg.num_hidden_layers}, got {layers}")
    cfg.num_hidden_layers = layers
    if isinstance(getattr(cfg, "layer_types", None), list):  # one entry per layer in some configs
        cfg.layer_types = cfg.layer_types[:layers]
    return cfg


def early_exit_draft(target: InvariantLM, layers: int):
    """A transformers model of the target's class with its first `layers` decoder layers, its final
    norm (copies, trainable) and its embeddings and LM head (the same storage, frozen). LoRA
    adapters are left out: the draft starts from the base weights."""
    cfg = _draft_config(target, layers)
    with torch.device("meta"):
        draft = type(target.causal)(cfg)
    source = target.causal
    for name, param in list(draft.named_parameters()):
        path, attr = name.rsplit(".", 1)
        value = getattr(_base(source.get_submodule(path)), attr).detach()
        shared = name in _SHARED or (cfg.tie_word_embeddings and name == "lm_head.weight")
        module = draft.get_submodule(path)
        setattr(module, attr, torch.nn.Parameter(value if shared else value.clone(), requires_grad=not shared))
    for name, buf in list(draft.named_buffers()):  # rotary tables: rebuilt for the real device
        path, attr = name.rsplit(".", 1)
        module = draft.get_submodule(path)
        module.register_buffer(attr, getattr(source.get_submodule(path), attr).detach().clone(), persistent=False)
    if cfg.tie_word_embeddings:
        draft.lm_head.weight = draft.model.embed_tokens.weight
    return draft.eval()


def load_draft(path: str | Path, target: InvariantLM, tokenizer):
    """A trained draft model from a transformers directory; refused unless its tokenizer and
    vocabulary are the target's (a draft token id must mean the same text to both)."""
    from lockstep.engine.loading import load_model

    draft, draft_tok = load_model(path)
    if draft.config.vocab_size != target.config.vocab_size:
        raise EngineError(f"model drafter: the draft model at {str(path)!r} has a vocabulary of {draft.config.vocab_size} "
                          f"tokens, the target {target.config.vocab_size}; use a draft trained on the target's tokenizer")
    if draft_tok.get_vocab() != tokenizer.get_vocab() or draft_tok.eos_token_id != tokenizer.eos_token_id:
        raise EngineError(f"model drafter: the draft model at {str(path)!r} has a different tokenizer from the target's; "
                          "use a draft trained on the target's tokenizer")
    for p in draft.parameters():
        p.requires_grad_(True)
    for name in _SHARED:
        draft.get_parameter(name).requires_grad_(False)
    return draft


def trainable_state(draft) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in draft.named_parameters() if p.requires_grad}


@dataclass(frozen=True)
class Published:
    version: int
    state: dict[str, torch.Tensor]
    data_version: int
    """The newest policy version among the samples the draft had learned from."""


class DraftTrainer:
    """Online distillation in a background thread: every `batch` finished samples, `updates`
    optimizer steps (on the newest samples, then on replays of the last `buffer` ones), then the
    new weights are published. A failing step is logged and counted; the thread goes on.
    The thread starts with the first full batch and ends after `idle_s` without one (a drafter that
    is dropped, as an evicted service session's, leaves no thread behind)."""

    def __init__(self, draft, *, lr: float = 1e-3, batch: int = 32, updates: int = 2, buffer: int = 512,
                 idle_s: float = 30.0):
        self.draft = draft.train()
        self.batch, self.updates = batch, updates
        self.opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        self._buffer: deque[tuple[list[int], int]] = deque(maxlen=buffer)
        self._new: list[tuple[list[int], int]] = []
        self._new_version = -1
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self.published: Published | None = None
        self.steps = self.errors = 0
        self.last_loss = float("nan")
        self._rng = random.Random(0)
        self.idle_s = idle_s
        self._thread: threading.Thread | None = None

    def observe(self, samples: Sequence[tuple[list[int], int]], policy_version: int) -> None:
        """samples: (prompt + completion tokens, prompt length) of finished rows."""
        with self._cond:
            self._new += [(list(s), n) for s, n in samples if len(s) > n]
            self._new_version = max(self._new_version, policy_version)
            if len(self._new) >= self.batch and not self._closed:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="draft-trainer", daemon=True)
                    self._thread.start()
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=30)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until every full batch observed so far has been learned from (tests, benchmarks)."""
        with self._cond:
            return self._cond.wait_for(lambda: (len(self._new) < self.batch and not self._busy) or self._closed, timeout)

    def _run(self) -> None:
        torch.set_grad_enabled(True)  # grad mode is per thread
        while True:
            with self._cond:
                ready = self._cond.wait_for(lambda: len(self._new) >= self.batch or self._closed, self.idle_s)
                if self._closed or not ready:
                    self._thread = None
                    self._cond.notify_all()
                    return
                fresh, self._new = self._new, []
                data_version = self._new_version
                self._busy = True
            self._buffer.extend(fresh)
            try:
                for u in range(self.updates):  # the newest samples first, then replays of the buffer
                    batch = fresh[-self.batch :] if u == 0 else self._rng.sample(list(self._buffer), min(len(self._buffer), self.batch))
                    self.last_loss = self._step(batch)
                    self.steps += 1
                version = self.published.version + 1 if self.published else 1
                self.published = Published(version, trainable_state(self.draft), data_version)
            except Exception:  # noqa: BLE001 - a draft that stops learning only costs speed
                self.errors += 1
                log.warning("the draft trainer's step failed (%d so far)", self.errors, exc_info=True)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _step(self, samples: list[tuple[list[int], int]]) -> float:
        """One cross-entropy step on the completions (the prompt is context only)."""
        T = max(len(s) for s, _ in samples)
        tokens = torch.zeros(len(samples), T, dtype=torch.long)
        labels = torch.full((len(samples), T), -100, dtype=torch.long)
        for i, (s, n) in enumerate(samples):
            tokens[i, : len(s)] = torch.tensor(s)
            labels[i, n : len(s)] = torch.tensor(s[n:])
        logits = self.draft(input_ids=tokens).logits[:, :-1]  # causal: right padding is never seen
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in self.draft.parameters() if p.requires_grad], 1.0)
        self.opt.step()
        return float(loss.detach())


class ModelDrafter:
    """Drafts with a small model (early_exit_draft or load_draft) that learns online (`train`).

    Options: layers (decoder layers of an early-exit draft, default 1), path (a trained draft in a
    transformers directory instead), train (learn from the generator's samples), lr, batch,
    updates, buffer (DraftTrainer's)."""

    def __init__(self, target: InvariantLM, tokenizer, *, layers: int = 1, path: str | None = None, train: bool = True,
                 lr: float = 1e-3, batch: int = 32, updates: int = 2, buffer: int = 512):
        for key, value, least in (("layers", layers, 1), ("batch", batch, 1), ("updates", updates, 1), ("buffer", buffer, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise EngineError(f"model drafter: {key} must be an integer >= {least}, got {value!r}")
        if not (isinstance(lr, (int, float)) and 0 < lr < 1):
            raise EngineError(f"model drafter: lr must be a number in (0, 1), got {lr!r}")
        hf = load_draft(path, target, tokenizer) if path else early_exit_draft(target, layers)
        self.model = InvariantLM(hf)
        self.version = 0
        """Published draft weights in use (0: the initial draft)."""
        self.data_version = -1
        """The newest policy version the draft in use had learned from (-1: none)."""
        self.trainer = DraftTrainer(_trainable_copy(hf), lr=lr, batch=batch, updates=updates, buffer=buffer) if train else None
        self.learning = train

    def session(self, prompts: Sequence[Sequence[int]], *, capacity: int, policy_version: int = 0) -> "ModelSession":
        self.refresh()
        return ModelSession(self, prompts, capacity, policy_version)

    def refresh(self) -> bool:
        """Swap in the trainer's newest weights, if any; True if the draft changed."""
        pub = self.trainer.published if self.trainer else None
        if pub is None or pub.version <= self.version:
            return False
        with torch.no_grad():
            for name, value in pub.state.items():
                self.model.hf_model.get_parameter(name).copy_(value)
        self.version, self.data_version = pub.version, pub.data_version
        return True

    def freeze(self) -> None:
        """Stop learning: wait for the trainer's pending step, swap in its last weights, end it."""
        if self.learning:
            self.trainer.wait_idle()
            self.refresh()
            self.trainer.close()
            self.learning = False

    def stats(self) -> dict:
        t = self.trainer
        return {"draft_version": self.version, "draft_data_version": self.data_version,
                "draft_train_steps": t.steps if t else 0, "draft_train_errors": t.errors if t else 0,
                "draft_loss": t.last_loss if t else float("nan")}

    def close(self) -> None:
        self.learning = False
        if self.trainer:
            self.trainer.close()


def _trainable_copy(hf):
    """The trainer's own draft: the same frozen shared weights, its own trainable ones."""
    shared = {id(p): p for p in hf.parameters() if not p.requires_grad}
    return copy.deepcopy(hf, memo=shared)


class ModelSession:
    """One sample() call's rows, drafted over the draft's own KV cache.

    fed[r]: tokens of row r whose keys and values the cache holds. After a draft, the drafted
    tokens sit in the cache past fed[r] (spec[r]); each one the target confirms is then already
    fed, so a fully accepted draft costs only the next token's feed."""

    def __init__(self, drafter: ModelDrafter, prompts, capacity: int, policy_version: int):
        self.drafter = drafter
        self.policy_version = policy_version
        self.prompt_lens = [len(p) for p in prompts]
        self.seqs = [list(p) for p in prompts]
        self.version = drafter.version
        self.capacity = capacity + 1
        self.slots = list(range(len(prompts)))  # row -> its cache row (-1: dropped)
        self.cache = drafter.model.new_cache(len(prompts), self.capacity)
        self.fed = [0] * len(prompts)
        self.spec: list[list[int]] = [[] for _ in prompts]

    def append(self, row: int, tokens: Sequence[int]) -> None:
        seq, spec = self.seqs[row], self.spec[row]
        for t in tokens:
            t = int(t)
            if spec and self.fed[row] == len(seq) and spec[0] == t:
                self.fed[row] += 1
                spec.pop(0)
            else:
                spec.clear()
            seq.append(t)

    def draft(self, rows: list[int], budgets: list[int], k: int) -> list[list[int]]:
        """Greedy drafts, up to min(k, budget) tokens, for each of `rows`."""
        if self.drafter.refresh() or self.version != self.drafter.version:  # new weights: the cache is stale
            self.version = self.drafter.version
            self.fed = [0] * len(self.seqs)
            self.spec = [[] for _ in self.seqs]
        live = [r for r, b in zip(rows, budgets) if b > 0]
        if not live or k <= 0:
            return [[] for _ in rows]
        self._compact(live)
        cache_rows = [r for r in range(len(self.seqs)) if self.slots[r] >= 0]
        cache_rows.sort(key=lambda r: self.slots[r])
        drafts = self._run(cache_rows, k)
        return [drafts.get(r, [])[: min(k, b)] if b > 0 else [] for r, b in zip(rows, budgets)]

    def _compact(self, live: list[int]) -> None:
        """Keep only the live rows' caches once they are at most half of those held."""
        held = sum(s >= 0 for s in self.slots)
        if len(live) * 2 > held:
            return
        keep = sorted(live, key=lambda r: self.slots[r])
        self.cache = self.cache.select(torch.tensor([self.slots[r] for r in keep]))
        self.slots = [-1] * len(self.seqs)
        for i, r in enumerate(keep):
            self.slots[r] = i

    def _run(self, cache_rows: list[int], k: int) -> dict[int, list[int]]:
        """Feed every held row's unfed tokens, then k - 1 drafts; each row's k greedy tokens."""
        model, cap, R = self.drafter.model, self.capacity - 1, len(cache_rows)
        pending = [self.seqs[r][self.fed[r] :] for r in cache_rows]
        lens = torch.tensor([len(p) for p in pending])
        T = max(1, int(lens.max()))
        tokens = torch.zeros(R, T, dtype=torch.long)
        tokens[torch.arange(T) < lens.unsqueeze(1)] = torch.tensor([t for p in pending for t in p], dtype=torch.long)
        # padding goes past each row's tokens: those slots are rewritten before anything attends to them
        positions = (torch.tensor([self.fed[r] for r in cache_rows]).unsqueeze(1) + torch.arange(T)).clamp(max=cap)
        last = (lens - 1).clamp(min=0)
        with torch.no_grad():
            hidden = model.hidden_states(tokens, positions, self.cache)
            nxt = model.logits(hidden[torch.arange(R), last]).argmax(-1)
            out = [nxt]
            pos = positions[torch.arange(R), last]
            for _ in range(k - 1):
                pos = (pos + 1).clamp(max=cap)
                nxt = model.logits(model.hidden_states(nxt.unsqueeze(1), pos.unsqueeze(1), self.cache)[:, 0]).argmax(-1)
                out.append(nxt)
        block = torch.stack(out, dim=1).tolist()
        result = {}
        for i, (r, p) in enumerate(zip(cache_rows, pending)):
            self.fed[r] += len(p)
            self.spec[r] = block[i][: k - 1]
            result[r] = block[i]
        return result

    def finish(self) -> None:
        """Hand every row's sample to the trainer."""
        if self.drafter.learning:
            self.drafter.trainer.observe(list(zip(self.seqs, self.prompt_lens)), self.policy_version)
