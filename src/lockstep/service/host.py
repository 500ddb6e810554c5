"""The engine host: holds trainers and samplers and executes queued requests, inside the worker's
Executor actor (one process: the claim loop calls it directly, no Ray hop per request).

It knows nothing of the store: the executor hands it a request (kind, payload, what the store says
about the model or sampling session) and writes back what it returns. Weights it must keep across
restarts (named saves, ephemeral sampler snapshots, a model's durable state) go to storage.

What it holds (service/models_cache.py, one LRU counted in bytes against `model_cache_bytes`):
- one `SharedBase` per base model (this host's device and dtype): the frozen base that every LoRA
  client and every LoRA or base sampling session of it runs on;
- per LoRA client (any of the SDK's target sets: attention, MLP, lm_head), an `AdapterTrainer` on
  that base: its adapter, gradients and AdamW moments;
- per full fine-tuning client, its own `Trainer`, a private copy of the model. That is all that
  stays private: a full fine-tune changes the base's own weights. (A LoRA the shared base cannot
  take, such as one on a mixture-of-experts base, is refused rather than copied.)
- per LoRA sampling session, its adapter snapshot (the shared base's sampler reads it per row); per
  full session, its pinned weights over a sampler skeleton (one per base model, whose parameters
  are pointed at the session's weights before a batch, without a copy).
Over the budget, the least recently used go first: a trainer is spilled to this host's spill
storage (save_state, plus the gradients accumulated since its last optim_step) and rebuilt from it,
bit for bit, on its next request; a session is reopened from its saved weights; a base goes only
when nothing resident runs on it. `max_models`, `max_sessions`, `max_skeletons` still cap the counts.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from lockstep.service.host_batches import (
    PackedBatches,
    encode_forward,
    encode_sample,
    sample_request,
    train_data,
)
from lockstep.service.models_cache import BudgetError, ModelCache, tensor_bytes

log = logging.getLogger("lockstep.host")

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
HEAD = ("lm_head",)
SHAREABLE = ATTN + MLP + HEAD
"""Targets a shared base adapts per row (engine/multi_lora.ADAPTABLE): every one lora_spec makes."""


class HostError(Exception):
    """A user error found while executing (the message goes back to the client)."""


def lora_spec(cfg: dict | None):
    from lockstep.engine.types import LoraSpec

    if not cfg or int(cfg.get("rank", 0)) == 0:
        return None
    targets = (ATTN if cfg.get("train_attn", True) else ()) + (MLP if cfg.get("train_mlp", True) else ())
    if cfg.get("train_unembed", True):
        targets += HEAD
    if not targets:
        raise HostError("lora_config trains nothing: set at least one of train_attn, train_mlp, train_unembed")
    # alpha = rank: the SDK sends no alpha; a scale of 1 keeps the adapter's step size independent of rank.
    return LoraSpec(rank=int(cfg["rank"]), alpha=float(cfg["rank"]), target_modules=targets, seed=int(cfg.get("seed") or 0))


def shares_base(spec) -> bool:
    """Whether a LoRA of this shape runs on the shared base (else on a private peft copy: none of the
    shapes lora_spec makes, since lm_head became a shared target; kept for any target added later)."""
    return spec is not None and set(spec.target_modules) <= set(SHAREABLE)


def default_cache_bytes(device: str) -> int:
    """Half the machine's memory (the worker's jobs, its fetch cache and the sampler's transient
    tensors use the rest); on a GPU host, three quarters of the device's."""
    if device != "cpu":
        import torch

        return torch.cuda.get_device_properties(0).total_memory * 3 // 4
    import psutil

    return psutil.virtual_memory().total // 2


@dataclass
class Session:
    """A sampling session held in memory."""

    base_path: str
    lora: dict | None
    adapter: object | None
    """On the shared base: its adapter snapshot (AdapterWeights), None for the bare base."""
    weights: dict | None
    """On a skeleton (full fine-tuning, private LoRA): its pinned weights by parameter name."""
    speculation: dict | None

    @property
    def shared(self) -> bool:
        return self.weights is None


@dataclass(frozen=True)
class Spilled:
    """A trainer evicted to spill storage: what rebuilds it."""

    key: str
    base_path: str
    lora: dict | None
    grads: bool
    """Whether gradients were pending (accumulated since the last optim_step) and saved too."""


class EngineHost(PackedBatches):
    def __init__(self, storage_url: str, cache_dir: str, threads: int, *, max_models: int = 16,
                 max_sessions: int = 32, max_skeletons: int = 4, fetch_cache_bytes: int = 4 << 30,
                 model_cache_bytes: int = 0, speculative: str = "off", draft_tokens: int = 4,
                 draft_timeout: float | None = 10.0, device: str = "cpu", dtype: str = "float32"):
        """model_cache_bytes: the budget of everything held in memory (0: `default_cache_bytes`).
        speculative: a drafter name (engine/drafters.py) for every sampling session, "off" for
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
        # Spills are this process's memory on disk: a new host (a restarted executor) rebuilds
        # from the store's durable state instead, so what an old one left is removed.
        shutil.rmtree(self.cache / "spill", ignore_errors=True)
        self.spill = Storage(str(self.cache / "spill"))
        self.spilled: dict[str, Spilled] = {}
        self.models = ModelCache(model_cache_bytes or default_cache_bytes(device),
                                 caps={"model": max_models, "session": max_sessions, "skeleton": max_skeletons})
        from lockstep.config.types import DRAFTERS

        if speculative not in DRAFTERS:  # an unknown name fails at start
            raise HostError(f"unknown drafter {speculative!r}; choose one of {', '.join(DRAFTERS)}")
        if speculative != "off" and device != "cpu":
            raise HostError("--speculative needs --device cpu: speculative decoding runs on the CPU path only, for now")
        self.speculative, self.draft_tokens, self.draft_timeout = speculative, draft_tokens, draft_timeout
        self.batch_stats: Counter = Counter()
        """Packed engine calls made by run_batch (train_calls, sample_calls) and the members they
        carried (train_packed_members, sample_packed_members): members that ran alone are not counted."""

    # -- what is held (read-only views, least recently used first) -------------------------------
    @property
    def trainers(self) -> dict:
        return {k[1]: self.models.peek(k) for k in self.models.keys("model")}

    @property
    def sessions(self) -> dict:
        return {k[1]: self.models.peek(k) for k in self.models.keys("session")}

    @property
    def bases(self) -> dict:
        return {k[1]: self.models.peek(k) for k in self.models.keys("base")}

    @property
    def skeletons(self) -> dict:
        return {k[1:]: self.models.peek(k) for k in self.models.keys("skeleton")}

    # -- shared bases ------------------------------------------------------------------------------
    def _base(self, base_path: str):
        """The shared base of a base model, loaded on first use."""
        from lockstep.engine.adapters import SharedBase

        key = ("base", base_path)
        if key not in self.models:
            base = SharedBase.from_pretrained(base_path, compute=self.compute)
            size = tensor_bytes([*base.hf_model.parameters(), *base.hf_model.buffers()])
            self._put(key, base, size, kind="base")
        return self.models.use(key)

    def _put(self, key, value, nbytes: int, **kw) -> None:
        try:
            self.models.put(key, value, nbytes, **kw)
        except BudgetError as e:
            raise HostError(str(e)) from None

    # -- models ----------------------------------------------------------------------------------
    def has_model(self, model_id: str) -> bool:
        return ("model", model_id) in self.models or model_id in self.spilled

    def drop_model(self, model_id: str) -> None:
        """Forget a model (memory and spill): the executor rebuilds it from the store if needed."""
        self.models.pop(("model", model_id))
        spilled = self.spilled.pop(model_id, None)
        if spilled is not None:
            self.spill.delete(spilled.key)

    def _trainer(self, model_id: str):
        key = ("model", model_id)
        if key not in self.models:
            if model_id not in self.spilled:
                raise HostError(f"model {model_id} is not loaded")
            self._unspill(model_id)
        return self.models.use(key)

    def _new_trainer(self, model_id: str, base_path: str, lora: dict | None):
        """(trainer, the key of the base it runs on or None): an AdapterTrainer on the shared base
        for a LoRA it can take, else a Trainer with its own copy of the model."""
        from lockstep.engine.adapters import AdapterTrainer
        from lockstep.engine.trainer import Trainer
        from lockstep.engine.types import EngineError

        spec = lora_spec(lora)
        if not shares_base(spec):
            return Trainer.from_pretrained(base_path, lora=spec, compute=self.compute), None
        base = self._base(base_path)
        try:
            return AdapterTrainer(base, spec, name=model_id), ("base", base_path)
        except EngineError as e:  # a rank or target this base cannot take
            raise HostError(str(e)) from None

    def _hold_model(self, model_id: str, trainer, needs, base_path: str, lora: dict | None) -> None:
        self._put(("model", model_id), trainer, trainer_bytes(trainer), kind="model", needs=needs,
                  evict=lambda: self._spill(model_id, trainer, base_path, lora))

    def create_model(self, model_id: str, base_path: str, lora: dict | None) -> dict:
        self.drop_model(model_id)  # a replayed create starts from scratch
        trainer, needs = self._new_trainer(model_id, base_path, lora)
        self._hold_model(model_id, trainer, needs, base_path, lora)
        return {"model_id": model_id, "type": "create_model"}

    def restore_state(self, model_id: str, base_path: str, lora: dict | None, storage_path: str,
                      optimizer: bool = True) -> None:
        """(Re)build a model from a saved state: create-via-load, or recovery after a restart."""
        if ("model", model_id) not in self.models:
            self.create_model(model_id, base_path, lora)
        trainer = self.models.use(("model", model_id))
        with self._fetch(storage_path) as local:
            trainer.load_state(local, optimizer=optimizer)

    def _spill(self, model_id: str, trainer, base_path: str, lora: dict | None) -> None:
        """Evict a trainer to spill storage: its save_state, and the gradients it has accumulated
        since its last optim_step (a model evicted between forward_backward and optim_step steps
        with them, as if it had never left)."""
        from lockstep.engine import checkpoint_io
        from lockstep.service.storage import unique_key

        key = unique_key("models", model_id.replace(":", "_"))
        grads = {n: p.grad.detach().cpu() for n, p in trainer.params.items() if p.grad is not None}
        with tempfile.TemporaryDirectory(dir=self.cache) as tmp:
            trainer.save_state(Path(tmp) / "state")
            self.spill.put_dir(Path(tmp) / "state", f"{key}/state")
            if grads:
                checkpoint_io.write_checkpoint(Path(tmp) / "grads", tensors={"grads": grads},
                                               meta={"format": "lockstep-pending-grads", "step": trainer.step})
                self.spill.put_dir(Path(tmp) / "grads", f"{key}/grads")
        self.spilled[model_id] = Spilled(key, base_path, lora, bool(grads))

    def _unspill(self, model_id: str) -> None:
        """Rebuild a spilled trainer exactly: weights, AdamW moments and step, pending gradients.
        The process's random state is left as it was (a state file carries the one at its save)."""
        from lockstep.engine import checkpoint_io

        spilled = self.spilled[model_id]
        rng = checkpoint_io.rng_state_tensors()
        trainer, needs = self._new_trainer(model_id, spilled.base_path, spilled.lora)
        with tempfile.TemporaryDirectory(dir=self.cache) as tmp:
            trainer.load_state(self.spill.get_dir(f"{spilled.key}/state", Path(tmp) / "state"))
            if spilled.grads:
                tensors, _ = checkpoint_io.read_checkpoint(self.spill.get_dir(f"{spilled.key}/grads", Path(tmp) / "grads"),
                                                           stems=("grads",))
                for name, p in trainer.params.items():
                    if name in tensors["grads"]:
                        p.grad = tensors["grads"][name].to(p.device, copy=True)
        checkpoint_io.restore_rng_state(rng)
        del self.spilled[model_id]
        self._hold_model(model_id, trainer, needs, spilled.base_path, spilled.lora)
        self.spill.delete(spilled.key)

    def _fetch(self, key: str):
        """A local copy of a saved state; one that is gone (deleted, expired) is the user's error."""
        if not self.storage.has_dir(key):
            raise HostError(f"the saved weights at {key.rsplit('/', 1)[-1]} no longer exist (deleted or expired)")
        return self.fetched.fetch(key)

    def forward_backward(self, model_id: str, body: bytes, forward_only: bool) -> tuple[bytes, int]:
        from lockstep.service import wire

        return self._forward_backward(model_id, wire.decode_forward_backward(body), forward_only)

    def _forward_backward(self, model_id: str, fb, forward_only: bool) -> tuple[bytes, int]:
        data = train_data(fb)
        trainer = self._trainer(model_id)
        try:
            run = trainer.forward if forward_only else trainer.forward_backward
            out = run(data, fb.loss_fn, fb.loss_fn_config)
        except ValueError as e:  # EngineError, LossError
            raise HostError(str(e)) from None
        return encode_forward(out, data)

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

    # -- packed batches (run_batch: host_batches.py) ---------------------------------------------
    def _check(self, kind: str, member):
        """What a member runs with, checked against the model it runs on (the stored payload is
        trusted no more than the API's input)."""
        from lockstep.config.types import LOSS_INPUTS
        from lockstep.service import sample_extras, wire

        if kind == "sample":
            session = self.sessions.get(member.key)
            if session is None:
                raise HostError(f"sampling session {member.key} is not open")
            runs_on = self._base(session.base_path) if session.shared else self._skeleton(session.base_path,
                                                                                           session.lora)[0]
            prompt = wire.tokens_from_model_input(member.payload["prompt"], "prompt")
            wire.check_tokens(prompt, runs_on.vocab_size, "prompt")
            sample_extras.check(member.payload, len(prompt), runs_on.vocab_size)
            return member.payload
        fb = wire.decode_forward_backward(member.payload)
        if fb.loss_fn not in LOSS_INPUTS:
            raise HostError(f"unknown loss_fn {fb.loss_fn!r}; choose one of {', '.join(LOSS_INPUTS)}")
        vocab = self._trainer(member.key).vocab_size
        for i, d in enumerate(fb.data):
            wire.check_datum(i, d.model_input, d.loss_fn_inputs, vocab)
        wire.check_loss_inputs(fb)
        return fb

    # -- sampling --------------------------------------------------------------------------------
    def _skeleton(self, base_path: str, lora: dict | None) -> tuple:
        """(trainer, sampler, original weights) for sessions with weights of their own (full fine-
        tuning, private LoRA): one per (base model, LoRA shape), not per LoRA seed (the seed only
        sets initial values, which a session's pinned weights replace)."""
        from lockstep.engine.sampler import Sampler
        from lockstep.engine.trainer import Trainer

        key = _skeleton_key(base_path, lora_spec(lora))
        if key not in self.models:
            t = Trainer.from_pretrained(base_path, lora=lora_spec(lora), compute=self.compute)
            self._put(key, (t, Sampler(t.model, t.tokenizer), {n: p.data for n, p in t.params.items()}),
                      tensor_bytes([*t.hf_model.parameters(), *t.hf_model.buffers()]), kind="skeleton")
        return self.models.use(key)

    def _hold_session(self, session_id: str, session: Session) -> None:
        if session.shared:
            needs = ("base", session.base_path)
            size = 0 if session.adapter is None else tensor_bytes(
                [t for f in session.adapter.factors.values() for t in (f.a, f.b)])
        else:
            needs = _skeleton_key(session.base_path, lora_spec(session.lora))
            skeleton = self.models.peek(needs)
            original = {id(w) for w in skeleton[2].values()} if skeleton is not None else set()
            size = tensor_bytes([w for w in session.weights.values() if id(w) not in original])
        # a session's weights are in storage already: evicting it only forgets it (reopened on demand)
        self._put(("session", session_id), session, size, kind="session", needs=needs)

    def open_session(self, session_id: str, base_path: str, lora: dict | None, weights_key: str | None) -> None:
        """Pin a sampling session to weights in storage (None: the base model itself)."""
        if ("session", session_id) in self.models:
            return
        spec = lora_spec(lora)
        if spec is None and weights_key is None or shares_base(spec):
            base = self._base(base_path)
            adapter = None
            if weights_key is not None:
                with self._fetch(weights_key) as local:
                    adapter = _load_adapter(local, base, spec, session_id)
            self._hold_session(session_id, Session(base_path, lora, adapter, None, self._speculation()))
            return
        trainer, _sampler, original = self._skeleton(base_path, lora)
        if weights_key is None:
            weights = original
        else:
            with self._fetch(weights_key) as local:
                weights = _load_weights(local, trainer)
        self._hold_session(session_id, Session(base_path, lora, None, weights, self._speculation()))

    def snapshot_session(self, model_id: str, session_id: str, key: str, base_path: str, lora: dict | None) -> int:
        """An ephemeral sampler on the model's current weights: persisted (for restarts), then
        pinned to a copy; returns the bytes written."""
        trainer = self._trainer(model_id)
        with self.models.pin(("model", model_id)):  # resident while its snapshot makes room
            size = self.save_state(model_id, key, optimizer=False)
            if hasattr(trainer, "snapshot"):  # an AdapterTrainer: its adapter, on the shared base
                session = Session(base_path, lora, trainer.snapshot(), None, self._speculation())
            else:
                session = Session(base_path, lora, None, {n: p.detach().to("cpu", copy=True)
                                                          for n, p in trainer.params.items()}, self._speculation())
            self._hold_session(session_id, session)
        return size

    def _speculation(self) -> dict | None:
        """A new session's drafter (built at its first sample, over the session's weights) and
        `auto` width controller, or None without speculation."""
        from lockstep.engine.speculative import AutoWidth

        return None if self.speculative == "off" else {"drafter": None, "auto": AutoWidth(self.draft_tokens)}

    def has_session(self, session_id: str) -> bool:
        return ("session", session_id) in self.models

    def drop_session(self, session_id: str) -> None:
        """Forget a sampling session (an inflight target whose weights moved on another worker)."""
        self.models.pop(("session", session_id))

    def _session_sampler(self, session_id: str, session: Session):
        """(sampler, the adapter its rows name or None) for a session: the shared base's, or its
        skeleton's, now holding the session's weights."""
        from lockstep.engine.sampler import Sampler

        if session.shared:
            base = self._base(session.base_path)
            model, tokenizer, adapter = base.model, base.tokenizer, session.adapter
        else:
            trainer, sampler, _ = self._skeleton(session.base_path, session.lora)
            _hold(trainer, session_id, session.weights)
            model, tokenizer, adapter = trainer.model, trainer.tokenizer, None
        if session.speculation is None:
            return Sampler(model, tokenizer), adapter
        from lockstep.engine.drafters import make_drafter

        speculation = session.speculation
        if speculation["drafter"] is None:
            speculation["drafter"] = make_drafter(self.speculative, target=model, tokenizer=tokenizer)
        return Sampler(model, tokenizer, drafter=speculation["drafter"], draft_tokens=self.draft_tokens,
                       auto=speculation["auto"], draft_timeout=self.draft_timeout), adapter

    def sample(self, session_id: str, body: dict) -> tuple[bytes, int]:
        """One sample request alone (run_batch packs those of shared sessions)."""
        from lockstep.engine.types import EngineError

        if ("session", session_id) not in self.models:
            raise HostError(f"sampling session {session_id} is not open")
        self.models.use(("session", session_id))
        with self.models.pin(("session", session_id)) as session:
            sampler, adapter = self._session_sampler(session_id, session)
            try:
                [res] = sampler.sample([sample_request(body, adapter)])
            except EngineError as e:
                raise HostError(str(e)) from None
            finally:
                if session.speculation is not None:  # this call's own sampler: its drafter thread ends with it
                    sampler.close()
        return encode_sample(res, body)


def trainer_bytes(trainer) -> int:
    """What a trainer holds once stepped: its weights (an AdapterTrainer: its adapter only; the base
    is counted once, as its own entry), and a gradient and two AdamW moments per trainable weight."""
    trainable = tensor_bytes(trainer.params.values())
    if hasattr(trainer, "base"):
        return 4 * trainable
    return tensor_bytes([*trainer.hf_model.parameters(), *trainer.hf_model.buffers()]) + 3 * trainable


def _skeleton_key(base_path: str, spec) -> tuple:
    return ("skeleton", base_path, None if spec is None else (spec.rank, spec.alpha, tuple(spec.target_modules)))


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


def _load_adapter(local: Path, base, spec, name: str):
    """A LoRA sampler snapshot (peft parameter names) as an adapter of the shared base."""
    from lockstep.engine import checkpoint_io
    from lockstep.engine.types import AdapterWeights, EngineError, LoraFactors

    tensors, meta = checkpoint_io.read_checkpoint(local, stems=("model",))
    try:
        fresh = base.new_adapter(spec, name=name)
    except EngineError as e:
        raise HostError(str(e)) from None
    weights, names = tensors["model"], base.param_names(fresh)
    if set(weights) != set(names) or any(weights[n].shape != t.shape for n, t in names.items()):
        raise HostError(f"sampler weights at {local.name} do not fit this model's LoRA shape")
    factors = {}
    for (layer, target), f in fresh.factors.items():
        stem = f"base_model.model.{base.module_name(layer, target)}"
        factors[(layer, target)] = LoraFactors(weights[f"{stem}.lora_A.default.weight"].to(base.compute.device),
                                               weights[f"{stem}.lora_B.default.weight"].to(base.compute.device), f.scaling)
    return AdapterWeights(name, int(meta.get("step", 0)), spec, factors)


def clear_cache(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
