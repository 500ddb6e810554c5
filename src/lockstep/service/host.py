"""The engine host: holds trainers and samplers and executes queued requests, inside the worker's
Executor actor (one process: the claim loop calls it directly, no Ray hop per request).

It knows nothing of the store: the executor hands it a request (kind, payload, what the store says
about the model or sampling session) and writes back what it returns. Weights it must keep across
restarts (named saves, ephemeral sampler snapshots, a model's durable state) go to storage.
Sampling sessions share one model skeleton per (base model, LoRA shape): before a batch, the
skeleton's trainable parameters are pointed at the session's pinned weights (no copy), so a
sampler stays on its snapshot while training goes on.

Memory is bounded: at most `max_models` trainers, `max_sessions` pinned sampler weights and
`max_skeletons` sampler skeletons are held, the least recently used dropped first. A dropped
trainer is rebuilt by the executor's replay (durable state + the finished requests after it), a
dropped session is reopened from storage, a dropped skeleton is built again.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

from lockstep.service.outcome import attempt

log = logging.getLogger("lockstep.host")

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class HostError(Exception):
    """A user error found while executing (the message goes back to the client)."""


def lora_spec(cfg: dict | None):
    from lockstep.engine.types import LoraSpec

    if not cfg or int(cfg.get("rank", 0)) == 0:
        return None
    targets = (ATTN if cfg.get("train_attn", True) else ()) + (MLP if cfg.get("train_mlp", True) else ())
    if cfg.get("train_unembed", True):
        targets += ("lm_head",)
    if not targets:
        raise HostError("lora_config trains nothing: set at least one of train_attn, train_mlp, train_unembed")
    # alpha = rank: the SDK sends no alpha; a scale of 1 keeps the adapter's step size independent of rank.
    return LoraSpec(rank=int(cfg["rank"]), alpha=float(cfg["rank"]), target_modules=targets, seed=int(cfg.get("seed") or 0))


class Lru(OrderedDict):
    """A dict of at most `capacity` entries: reading one (`use`) makes it the newest, adding one
    past capacity drops the oldest."""

    def __init__(self, capacity: int, what: str):
        super().__init__()
        self.capacity, self.what = max(1, capacity), what

    def use(self, key):
        self.move_to_end(key)
        return self[key]

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.capacity:
            old, _ = self.popitem(last=False)
            log.info("dropped %s %s from memory (least recently used of %d)", self.what, old, self.capacity)


class EngineHost:
    def __init__(self, storage_url: str, cache_dir: str, threads: int, *, max_models: int = 16,
                 max_sessions: int = 32, max_skeletons: int = 4, fetch_cache_bytes: int = 4 << 30,
                 speculative: str = "off", draft_tokens: int = 4, draft_timeout: float | None = 10.0,
                 device: str = "cpu", dtype: str = "float32"):
        """speculative: a drafter name (engine/drafters.py) for every sampling session, "off" for
        none. Each session gets its own drafter and `auto` width controller: its history of
        completions never drafts for another session (another tenant), and it speculates only where
        its own measurements say it pays. Outputs are those of plain decoding either way."""
        import torch

        from lockstep.engine.device import Compute
        from lockstep.service.storage import FetchCache, Storage

        torch.set_num_threads(threads)
        self.compute = Compute(device, dtype)
        self.compute.check()
        self.storage = Storage(storage_url)
        self.cache = Path(cache_dir)
        self.cache.mkdir(parents=True, exist_ok=True)
        self.fetched = FetchCache(self.storage, self.cache / "fetched", fetch_cache_bytes)
        self.trainers = Lru(max_models, "model")
        self.skeletons = Lru(max_skeletons, "sampler skeleton")
        """One per (base model, LoRA shape), rebuilt on demand."""
        self.sessions = Lru(max_sessions, "sampling session")
        from lockstep.config.types import DRAFTERS

        if speculative not in DRAFTERS:  # an unknown name fails at start
            raise HostError(f"unknown drafter {speculative!r}; choose one of {', '.join(DRAFTERS)}")
        if speculative != "off" and device != "cpu":
            raise HostError("--speculative needs --device cpu: speculative decoding runs on the CPU path only, for now")
        self.speculative, self.draft_tokens, self.draft_timeout = speculative, draft_tokens, draft_timeout

    # -- models ----------------------------------------------------------------------------------
    def has_model(self, model_id: str) -> bool:
        return model_id in self.trainers

    def drop_model(self, model_id: str) -> None:
        self.trainers.pop(model_id, None)

    def _trainer(self, model_id: str):
        if model_id not in self.trainers:
            raise HostError(f"model {model_id} is not loaded")
        return self.trainers.use(model_id)

    def create_model(self, model_id: str, base_path: str, lora: dict | None) -> dict:
        from lockstep.engine.trainer import Trainer

        self.trainers.put(model_id, Trainer.from_pretrained(base_path, lora=lora_spec(lora), compute=self.compute))
        return {"model_id": model_id, "type": "create_model"}

    def restore_state(self, model_id: str, base_path: str, lora: dict | None, storage_path: str,
                      optimizer: bool = True) -> None:
        """(Re)build a model from a saved state: create-via-load, or recovery after a restart."""
        from lockstep.engine.trainer import Trainer

        trainer = self.trainers.get(model_id)
        if trainer is None:
            trainer = Trainer.from_pretrained(base_path, lora=lora_spec(lora), compute=self.compute)
        with self._fetch(storage_path) as local:
            trainer.load_state(local, optimizer=optimizer)
        self.trainers.put(model_id, trainer)

    def _fetch(self, key: str):
        """A local copy of a saved state; one that is gone (deleted, expired) is the user's error."""
        if not self.storage.has_dir(key):
            raise HostError(f"the saved weights at {key.rsplit('/', 1)[-1]} no longer exist (deleted or expired)")
        return self.fetched.fetch(key)

    def forward_backward(self, model_id: str, body: bytes, forward_only: bool) -> tuple[bytes, int]:
        from lockstep.service import wire

        return self._forward_backward(model_id, wire.decode_forward_backward(body), forward_only)

    def _forward_backward(self, model_id: str, fb, forward_only: bool) -> tuple[bytes, int]:
        from lockstep.engine.types import Datum, EngineError
        from lockstep.service import wire

        data = [Datum(d.model_input, d.loss_fn_inputs) for d in fb.data]
        trainer = self._trainer(model_id)
        try:
            run = trainer.forward if forward_only else trainer.forward_backward
            out = run(data, fb.loss_fn, fb.loss_fn_config)
        except (EngineError, ValueError) as e:
            raise HostError(str(e)) from None
        tokens = sum(len(d.model_input) for d in data)
        return wire.encode_forward_output(out.loss_fn_outputs, out.metrics), tokens

    def optim_step(self, model_id: str, adam: dict) -> dict:
        from lockstep.engine.types import AdamParams, EngineError

        trainer = self._trainer(model_id)
        try:  # the stored payload is not trusted: unknown keys, non-numbers and out-of-range values are refused
            params = AdamParams(**adam)
        except TypeError as e:
            raise HostError(f"adam_params: {e}") from None
        except EngineError as e:
            raise HostError(str(e)) from None
        try:
            metrics = trainer.optim_step(params)
        except EngineError as e:
            raise HostError(str(e)) from None
        return {"metrics": metrics, "type": "optim_step"}

    def save_state(self, model_id: str, key: str, optimizer: bool = True) -> int:
        """Weights (and optimizer) to storage under `key`; returns the bytes written."""
        trainer = self._trainer(model_id)
        with tempfile.TemporaryDirectory(dir=self.cache) as tmp:
            path = Path(tmp) / "state"
            if optimizer:
                trainer.save_state(path)
            else:
                _save_weights(trainer, path)
            return self.storage.put_dir(path, key)

    # -- packed batches --------------------------------------------------------------------------
    def run_batch(self, kind: str, members) -> list:
        """Run a batch of one kind ("forward", "forward_backward" or "sample"; service/packing.py),
        each member on its own model or sampling session (BatchMember), which the caller has
        readied. One result per member, in order: (result body, tokens), or the exception that
        failed that member alone. Every member is checked before any runs, so a bad one (a token
        id out of its model's vocabulary, a loss input missing, a session gone) touches nothing.

        The members run one after another until the engine's packed forward lands; that call
        replaces `_run_checked` here and nowhere else."""
        checked = [attempt(self._check, kind, m) for m in members]
        return [c if isinstance(c, Exception) else attempt(self._run_checked, kind, m.key, c)
                for m, c in zip(members, checked)]

    def _check(self, kind: str, member):
        """What a member runs with, checked against the model it runs on (the stored payload is
        trusted no more than the API's input)."""
        from lockstep.config.types import LOSS_INPUTS
        from lockstep.service import wire

        if kind == "sample":
            if member.key not in self.sessions:
                raise HostError(f"sampling session {member.key} is not open")
            trainer, _, _ = self._skeleton(*self.sessions[member.key][:2])
            wire.check_tokens(wire.tokens_from_model_input(member.payload["prompt"], "prompt"), trainer.vocab_size,
                              "prompt")
            return member.payload
        fb = wire.decode_forward_backward(member.payload)
        if fb.loss_fn not in LOSS_INPUTS:
            raise HostError(f"unknown loss_fn {fb.loss_fn!r}; choose one of {', '.join(LOSS_INPUTS)}")
        vocab = self._trainer(member.key).vocab_size
        for i, d in enumerate(fb.data):
            wire.check_datum(i, d.model_input, d.loss_fn_inputs, vocab)
        wire.check_loss_inputs(fb)
        return fb

    def _run_checked(self, kind: str, key: str, checked) -> tuple[bytes, int]:
        if kind == "sample":
            return self.sample(key, checked)
        return self._forward_backward(key, checked, kind == "forward")

    # -- sampling --------------------------------------------------------------------------------
    def _skeleton(self, base_path: str, lora: dict | None) -> tuple:
        """(trainer, sampler, original weights): one per (base model, LoRA shape), not per LoRA seed
        (the seed only sets initial values, which a session's pinned weights replace)."""
        from lockstep.engine.sampler import Sampler
        from lockstep.engine.trainer import Trainer

        spec = lora_spec(lora)
        key = (base_path, None if spec is None else (spec.rank, spec.alpha, tuple(spec.target_modules)))
        if key not in self.skeletons:
            t = Trainer.from_pretrained(base_path, lora=spec, compute=self.compute)
            self.skeletons.put(key, (t, Sampler(t.model, t.tokenizer), {n: p.data for n, p in t.params.items()}))
        return self.skeletons.use(key)

    def open_session(self, session_id: str, base_path: str, lora: dict | None, weights_key: str | None) -> None:
        """Pin a sampling session to weights in storage (None: the base model itself)."""
        if session_id in self.sessions:
            return
        trainer, _sampler, original = self._skeleton(base_path, lora)
        if weights_key is None:
            weights = original
        else:
            with self._fetch(weights_key) as local:
                weights = _load_weights(local, trainer)
        self.sessions.put(session_id, (base_path, lora, weights, self._speculation()))

    def snapshot_session(self, model_id: str, session_id: str, key: str, base_path: str, lora: dict | None) -> int:
        """An ephemeral sampler on the model's current weights: persisted (for restarts), then
        pinned to a copy; returns the bytes written."""
        trainer = self._trainer(model_id)
        size = self.save_state(model_id, key, optimizer=False)
        self.sessions.put(session_id, (base_path, lora, {n: p.detach().to("cpu", copy=True)
                                                         for n, p in trainer.params.items()}, self._speculation()))
        return size

    def _speculation(self) -> dict | None:
        """A new session's drafter (built at its first sample, over the session's weights) and
        `auto` width controller, or None without speculation."""
        from lockstep.engine.speculative import AutoWidth

        return None if self.speculative == "off" else {"drafter": None, "auto": AutoWidth(self.draft_tokens)}

    def has_session(self, session_id: str) -> bool:
        return session_id in self.sessions

    def sample(self, session_id: str, body: dict) -> tuple[bytes, int]:
        from lockstep.engine.types import EngineError, SampleRequest, SamplingParams
        from lockstep.service import wire

        if session_id not in self.sessions:
            raise HostError(f"sampling session {session_id} is not open")
        base_path, lora, weights, speculation = self.sessions.use(session_id)
        trainer, sampler, _ = self._skeleton(base_path, lora)
        _hold(trainer, session_id, weights)
        if speculation is not None:
            from lockstep.engine.drafters import make_drafter
            from lockstep.engine.sampler import Sampler

            if speculation["drafter"] is None:
                speculation["drafter"] = make_drafter(self.speculative, target=trainer.model, tokenizer=trainer.tokenizer)
            sampler = Sampler(trainer.model, trainer.tokenizer, drafter=speculation["drafter"],
                              draft_tokens=self.draft_tokens, auto=speculation["auto"], draft_timeout=self.draft_timeout)
        p = body["sampling_params"]
        stop = p.get("stop")
        stop = (stop,) if isinstance(stop, str) else (tuple(stop) if stop is not None else None)
        prompt = wire.tokens_from_model_input(body["prompt"], "prompt")
        try:
            params = SamplingParams(max_tokens=p.get("max_tokens") or 256, temperature=float(p.get("temperature", 1.0)),
                                    top_p=float(p.get("top_p", 1.0)), top_k=int(p.get("top_k", -1)), stop=stop,
                                    seed=p.get("seed"))
            [res] = sampler.sample([SampleRequest(prompt, params, num_samples=int(body.get("num_samples", 1)),
                                                  prompt_logprobs=bool(body.get("prompt_logprobs")))])
        except EngineError as e:
            raise HostError(str(e)) from None
        finally:
            if speculation is not None:  # this call's own sampler: its drafter thread ends with it
                sampler.close()
        seqs = [(s.tokens, s.logprobs, s.stop_reason) for s in res.sequences]
        tokens = sum(len(s.tokens) for s in res.sequences)
        return wire.encode_sample_response(seqs, res.prompt_logprobs), tokens


def _hold(trainer, session_id: str, weights: dict) -> None:
    """Point a skeleton's parameters at a session's pinned weights: on the CPU without a copy; on a
    GPU host a copy onto the device, skipped while the skeleton still holds that session's (pinned
    weights live in host memory: max_sessions copies of a model would not fit on one GPU)."""
    on_device = next(iter(trainer.params.values())).device.type != "cpu"
    if on_device and getattr(trainer, "held_session", None) == session_id:
        return
    for name, p in trainer.params.items():
        w = weights[name]
        p.data = w if w.device == p.device else w.to(p.device)
    trainer.held_session = session_id


def _save_weights(trainer, path: Path) -> None:
    """Trainable weights only (a sampler snapshot), in the engine's atomic checkpoint format."""
    from lockstep.engine import checkpoint_io

    meta = {"format": "lockstep-sampler-weights", "base_model": trainer.base_model, "step": trainer.step,
            "lora_rank": trainer.lora.rank if trainer.lora else 0}
    checkpoint_io.write_checkpoint(path, tensors={"model": {n: p.detach().cpu() for n, p in trainer.params.items()}},
                                   meta=meta)


def _load_weights(local: Path, trainer) -> dict:
    from lockstep.engine import checkpoint_io

    tensors, _meta = checkpoint_io.read_checkpoint(local, stems=("model",))
    weights = tensors["model"]
    missing = set(trainer.params) - set(weights)
    if missing:
        raise HostError(f"sampler weights at {local.name} do not fit this model (missing {sorted(missing)[:3]})")
    return {n: weights[n] for n in trainer.params}  # in host memory (see _hold)


def clear_cache(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
