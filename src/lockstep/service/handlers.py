"""The Executor's handlers: what each kind of request does on the engine host, and what its result
commits with it (an Outcome; see commit.py). A handler raises UserError, ServiceError or HostError
for what the request asked wrongly; it trusts nothing in the store (rows may have been written
behind the API's back).

A model the host does not hold is rebuilt first (recovery.py), except by the requests that make it.

A packed batch (packing.py) is readied member by member (its model rebuilt, its sampling session
opened), then run by the host in one call (`EngineHost.run_batch`); a member that cannot be readied
or run fails alone, and the others get their results (`execute_batch`).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Sequence

from sqlalchemy import bindparam, select

from lockstep.service import janitor, queue, stability
from lockstep.service.db import BaseModelEntry, Checkpoint, Model, SamplingSession, now
from lockstep.service.outcome import Outcome, UserError, attempt
from lockstep.service.packing import PACKED_KINDS
from lockstep.service.storage import unique_key
from lockstep.service.types import BatchMember, RequestKind, UsageKind, WorkerConfig

# Core, built once: it runs on every training request (see queue.py).
_MODEL = select(Model.__table__).where(Model.__table__.c.id == bindparam("mid"))
MAX_TTL_S = 100 * 365 * 86400
"""Longest checkpoint time-to-live (100 years): beyond it the expiry date does not fit the store."""


def safe(model_id: str) -> str:
    """A model id as one storage key component."""
    return model_id.replace(":", "_")


def payload_json(req) -> dict:
    try:
        payload = json.loads(req.payload)
    except (TypeError, ValueError) as e:
        raise UserError(f"{req.kind} request {req.id}: payload is not JSON ({e})") from None
    if not isinstance(payload, dict):
        raise UserError(f"{req.kind} request {req.id}: payload must be a JSON object")
    return payload


def _expiry(ttl) -> dt.datetime | None:
    """expires_at for a ttl_seconds (None or 0: never), checked before anything is written."""
    if ttl is None or ttl == 0:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 0 < ttl <= MAX_TTL_S:
        raise UserError(f"ttl_seconds must be a whole number of seconds from 1 to {MAX_TTL_S} (100 years), got {ttl!r}")
    return now() + dt.timedelta(seconds=ttl)


class Handlers:
    """Runs one request on the host: `execute(req) -> Outcome`."""

    def __init__(self, host, sessions, storage, config: WorkerConfig, ensure_model: Callable):
        self.host, self.sessions, self.storage, self.config = host, sessions, storage, config
        self.ensure_model = ensure_model
        """recovery.Recovery.ensure_model: rebuild a model the host does not hold."""
        self.base_paths: dict[str, str] = {}
        """Base model name -> directory; registered once and never changed, so read once."""
        self.inflight: dict[str, str] = {}
        """Inflight target id -> the weights key this worker's host holds for it."""
        self.sampled_with: dict[str, str | None] = {}
        """Sample request id -> the weights key it runs on, from readying to its outcome."""

    def base_path(self, s, name: str) -> str:
        if name not in self.base_paths:
            entry = s.get(BaseModelEntry, name)
            if entry is None:
                raise UserError(f"base model {name!r} is not registered on this worker")
            self.base_paths[name] = entry.path
        return self.base_paths[name]

    def execute_batch(self, members: Sequence[queue.Claimed]) -> list[Outcome | Exception]:
        """Run a claimed batch: one Outcome, or the exception that failed it, per member. A kind
        that runs alone comes as a batch of one."""
        kind = members[0].kind
        assert all(m.kind == kind for m in members) and (kind in PACKED_KINDS or len(members) == 1)
        if kind not in PACKED_KINDS:
            return [attempt(self.execute, members[0])]
        ready = [attempt(self._ready, m) for m in members]
        runs = [i for i, r in enumerate(ready) if isinstance(r, BatchMember)]
        ran = self.host.run_batch(kind, [ready[i] for i in runs])
        out: list = list(ready)
        for i, r in zip(runs, ran):
            out[i] = r if isinstance(r, Exception) else _packed_outcome(kind, *r)
        if kind == RequestKind.SAMPLE.value:
            for i, m in enumerate(members):
                weights = self.sampled_with.pop(m.id, None)
                if isinstance(out[i], Outcome):
                    out[i].update = stability.record_update(ready[i].payload, out[i].result, weights)
        return out

    def execute(self, req: queue.Claimed) -> Outcome:
        if req.kind in PACKED_KINDS:
            [out] = self.execute_batch([req])
            if isinstance(out, Exception):
                raise out
            return out
        kind = RequestKind(req.kind)
        model, base_path = self._model(req)
        if kind not in (RequestKind.CREATE_MODEL, RequestKind.LOAD_WEIGHTS) or req.seq_id != 0:
            self.ensure_model(model, base_path)
        return HANDLERS[kind](self, req, model, base_path)

    def _model(self, req: queue.Claimed):
        with self.sessions() as s:
            model = s.execute(_MODEL, {"mid": req.model_id}).first()
            if model is None:  # the API checks it exists; only a row deleted behind its back lacks one
                raise UserError(f"unknown model_id {req.model_id!r}")
            return model, self.base_path(s, model.base_model)

    def _ready(self, req: queue.Claimed) -> BatchMember:
        """A packed request's model rebuilt (or its sampling session opened), before the batch runs."""
        if req.kind == RequestKind.SAMPLE.value:
            with self.sessions() as s:
                ss = s.get(SamplingSession, req.sampling_session_id)
                if ss is None:  # the API checks it exists; only a row deleted behind its back (expired) lacks one
                    raise UserError(f"unknown sampling_session_id {req.sampling_session_id!r}")
                base_path = self.base_path(s, ss.base_model)
                key, weights = self._sample_target(s, ss)
            if key in self.inflight and self.inflight[key] != weights and self.host.has_session(key):
                self.host.drop_session(key)  # an inflight save elsewhere moved the target
            if not self.host.has_session(key):
                self.host.open_session(key, base_path, ss.lora_config, weights)
                if ss.inflight_of:
                    self.inflight[key] = weights
            self.sampled_with[req.id] = weights
            return BatchMember(key, payload_json(req))
        model, base_path = self._model(req)
        self.ensure_model(model, base_path)
        return BatchMember(model.id, req.payload)

    @staticmethod
    def _sample_target(s, ss) -> tuple[str, str | None]:
        """(the host session a sampling session samples on, its weights key): its own, or for an
        inflight client its model's inflight target's latest."""
        if not ss.inflight_of:
            return ss.id, ss.weights_path
        target = s.get(SamplingSession, ss.inflight_of)
        if target is None:  # created with the client's row, deleted only with it (janitor.sweep)
            raise UserError(f"inflight sampling session {ss.id} has lost its target {ss.inflight_of}")
        return target.id, target.weights_path

    # -- training requests -----------------------------------------------------------------------
    def _create_model(self, req, model, base_path) -> Outcome:
        return Outcome(json.dumps(create_model(self.host, req, model, base_path)).encode())

    def _load_weights(self, req, model, base_path) -> Outcome:
        p = payload_json(req)
        self.host.restore_state(model.id, base_path, model.lora_config, p["storage_path"], bool(p.get("optimizer")))
        out = Outcome(json.dumps({"path": p["path"], "model_id": model.id, "type": "load_weights"}).encode())
        if self.config.persist_every:  # the model's durable state must not depend on a checkpoint its owner may delete
            self._persist(req, model, out)
        return out

    def _optim_step(self, req, model, base_path) -> Outcome:
        adam = payload_json(req).get("adam_params")
        if not isinstance(adam, dict):
            raise UserError("optim_step needs adam_params (an object)")
        metrics = self.host.optim_step(model.id, adam)
        out = Outcome(json.dumps(metrics).encode())
        every = self.config.persist_every
        if every and int(metrics["metrics"].get("step:max", 0)) % every == 0:
            self._persist(req, model, out)
        return out

    def _persist(self, req, model, out: Outcome) -> None:
        """Write the model's state under a new key; the pointer moves with the result's commit,
        and the state it replaces is deleted only after that commit."""
        key = unique_key(f"models/{safe(model.id)}", f"state-{req.seq_id:08d}")
        self.host.save_state(model.id, key, True)

        def update(s):
            row = s.get(Model, model.id)
            row.state_path, row.state_seq = key, req.seq_id

        out.update = update
        out.after_commit = (lambda: self._delete_unreferenced(model.state_path)) if model.state_path else None
        out.on_abort = lambda: self._delete_unreferenced(key)

    # -- saves -----------------------------------------------------------------------------------
    def _save(self, req, model, kind: str, optimizer: bool) -> Outcome:
        """A named save (weights/<name> or sampler_weights/<name>): a new key each time; a re-used
        name then points at it, and the copy it replaced is deleted unless a sampler is pinned to it."""
        p = payload_json(req)
        name = p.get("name")
        if not isinstance(name, str) or not name:
            raise UserError(f"{req.kind} needs a name")
        expires = _expiry(p.get("ttl_seconds"))
        meta = p.get("user_metadata") or {}
        if not isinstance(meta, dict):
            raise UserError("user_metadata must be an object")
        with self.sessions() as s:
            old = s.scalar(select(Checkpoint).where(Checkpoint.model_id == model.id, Checkpoint.kind == kind,
                                                    Checkpoint.name == name))
        if old is not None and kind == "weights" and not p.get("overwrite"):
            raise UserError(f"checkpoint weights/{name} already exists for {model.id}; pass overwrite=True to replace it")
        key = unique_key(f"checkpoints/{model.tenant_id}/{safe(model.id)}", f"{kind}/{name}")
        size = self.host.save_state(model.id, key, optimizer)

        def update(s):
            ck = s.scalar(select(Checkpoint).where(Checkpoint.model_id == model.id, Checkpoint.kind == kind,
                                                   Checkpoint.name == name))
            if ck is None:
                ck = Checkpoint(tenant_id=model.tenant_id, model_id=model.id, kind=kind, name=name, storage_path=key)
                s.add(ck)
            ck.storage_path, ck.size_bytes, ck.created_at, ck.expires_at = key, size, now(), expires
            ck.user_metadata = meta

        replaced = old.storage_path if old is not None else None
        return Outcome(json.dumps({"path": f"tinker://{model.id}/{kind}/{name}", "type": req.kind}).encode(),
                       update=update, on_abort=lambda: self._delete_unreferenced(key),
                       after_commit=(lambda: self._delete_unreferenced(replaced)) if replaced else None)

    def _delete_unreferenced(self, key: str) -> None:
        """Asked after a commit, or after one that failed in a way that may still have committed:
        it must never remove something the store points at."""
        janitor.delete_unreferenced(self.sessions, self.storage, key)

    def _save_weights(self, req, model, base_path) -> Outcome:
        return self._save(req, model, "weights", optimizer=True)

    def _save_weights_external(self, req, model, base_path) -> Outcome:
        return self._save(req, model, "external_weights", optimizer=False)

    def _save_weights_for_sampler(self, req, model, base_path) -> Outcome:
        p = payload_json(req)
        if p.get("name"):
            return self._save(req, model, "sampler_weights", optimizer=False)
        seq = p.get("sampling_session_seq_id")
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise UserError("save_weights_for_sampler needs a name or an integer sampling_session_seq_id")
        ssid = f"{model.id}:sample:{seq}"
        if p.get("kind") == "inflight":
            return self._save_inflight(model, base_path, ssid)
        key = unique_key(f"ephemeral/{model.tenant_id}", safe(ssid))
        self.host.snapshot_session(model.id, ssid, key, base_path, model.lora_config)

        def update(s):
            if s.get(SamplingSession, ssid) is None:
                s.add(SamplingSession(id=ssid, tenant_id=model.tenant_id, session_id=model.session_id,
                                      base_model=model.base_model, weights_path=key, lora_rank=model.lora_rank,
                                      lora_config=model.lora_config, vocab_size=model.vocab_size))

        return Outcome(json.dumps({"sampling_session_id": ssid, "type": "save_weights_for_sampler"}).encode(),
                       update=update, on_abort=lambda: self._delete_unreferenced(key))


    def _save_inflight(self, model, base_path: str, ssid: str) -> Outcome:
        """An inflight save: the model's one inflight target (`<model>:inflight`) moves to the
        current weights, written under a new key and swapped in place on this host (the very
        snapshot a snapshot save makes); `ssid` becomes a client sampling the target's latest."""
        target = f"{model.id}:inflight"
        key = unique_key(f"ephemeral/{model.tenant_id}", safe(target))
        self.host.snapshot_session(model.id, target, key, base_path, model.lora_config)
        self.inflight[target] = key
        with self.sessions() as s:
            old = s.get(SamplingSession, target)
            replaced = old.weights_path if old is not None else None

        def update(s):
            row = s.get(SamplingSession, target)
            if row is None:
                row = SamplingSession(id=target, tenant_id=model.tenant_id, session_id=model.session_id,
                                      base_model=model.base_model, lora_rank=model.lora_rank,
                                      lora_config=model.lora_config, vocab_size=model.vocab_size)
                s.add(row)
            row.weights_path = key
            if s.get(SamplingSession, ssid) is None:
                s.add(SamplingSession(id=ssid, tenant_id=model.tenant_id, session_id=model.session_id,
                                      base_model=model.base_model, lora_rank=model.lora_rank,
                                      lora_config=model.lora_config, vocab_size=model.vocab_size,
                                      inflight_of=target))

        return Outcome(json.dumps({"sampling_session_id": ssid, "type": "save_weights_for_sampler"}).encode(),
                       update=update, on_abort=lambda: self._delete_unreferenced(key),
                       after_commit=(lambda: self._delete_unreferenced(replaced)) if replaced else None)


def _packed_outcome(kind: str, body: bytes, tokens: int) -> Outcome:
    usage = {RequestKind.FORWARD_BACKWARD.value: {UsageKind.TOKENS_TRAINED: tokens},
             RequestKind.SAMPLE.value: {UsageKind.TOKENS_SAMPLED: tokens}}.get(kind, {})
    return Outcome(body, "proto", usage)


HANDLERS: dict[RequestKind, Callable[..., Outcome]] = {
    RequestKind.CREATE_MODEL: Handlers._create_model,
    RequestKind.LOAD_WEIGHTS: Handlers._load_weights,
    RequestKind.OPTIM_STEP: Handlers._optim_step,
    RequestKind.SAVE_WEIGHTS: Handlers._save_weights,
    RequestKind.SAVE_WEIGHTS_FOR_SAMPLER: Handlers._save_weights_for_sampler,
    RequestKind.SAVE_WEIGHTS_EXTERNAL: Handlers._save_weights_external,
}
"""Kind -> handler of the kinds that run alone (the packed kinds go through execute_batch)."""
assert set(HANDLERS) == {k for k in RequestKind if k.value not in PACKED_KINDS}


# -- effects on a model, replayed when it is rebuilt (recovery.py) ---------------------------------
def create_model(host, req, model, base_path) -> dict:
    lora = payload_json(req).get("lora_config")
    return host.create_model(model.id, base_path, lora if isinstance(lora, dict) else None)


def _load_weights(host, req, model, base_path) -> None:
    p = json.loads(req.payload)
    host.restore_state(model.id, base_path, model.lora_config, p["storage_path"], bool(p.get("optimizer")))


REPLAY: dict[RequestKind, Callable] = {
    RequestKind.CREATE_MODEL: create_model,
    RequestKind.LOAD_WEIGHTS: _load_weights,
    RequestKind.FORWARD_BACKWARD: lambda host, r, model, base: host.forward_backward(model.id, r.payload, False),
    RequestKind.OPTIM_STEP: lambda host, r, model, base: host.optim_step(model.id, json.loads(r.payload)["adam_params"]),
}
"""How a finished request's effect is re-applied when its model is rebuilt (its result is kept)."""
assert set(REPLAY) == {k for k in RequestKind if k.changes_model}
