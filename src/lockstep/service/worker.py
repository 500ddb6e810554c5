"""The worker: claims queued requests from the store, runs them on the engine host, writes results.

Exactly-once effects across crashes: a model's state lives in the host's memory, and after every
`persist_every` optimizer steps it is also written to storage under a key versioned by seq_id, and
the store's pointer (state_path, state_seq) moves in the same transaction that finishes the
request. A fresh worker (or a restarted host) rebuilds a model lazily, on its next request: it
loads the pointed-to state and replays, in seq order, the finished requests after it that change
the model (their results were already delivered and are not rewritten). Requests a dead worker
had claimed go back to the queue.
"""

from __future__ import annotations

import json
import logging
import os
import select as select_mod
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import ray
from sqlalchemy import bindparam, insert, select

from lockstep.service import doorbell, queue
from lockstep.service.db import BaseModelEntry, Checkpoint, Model, Request, SamplingSession, Usage, connect, now
from lockstep.service.scheduler import SLOT, Scheduler, adopt_orphans
from lockstep.service.storage import Storage
from lockstep.service.types import BUILTIN_MODEL, RequestKind, RequestState, ServiceError, UsageKind

log = logging.getLogger("lockstep.worker")
# Core, built once: these run on every request (see queue.py).
_MODEL = select(Model.__table__).where(Model.__table__.c.id == bindparam("mid"))
_INSERT_USAGE = insert(Usage.__table__)


@dataclass(frozen=True)
class WorkerConfig:
    db_url: str
    storage_url: str
    home: str
    """Local working directory (model cache, Ray temp files)."""
    ray_address: str = ""
    models: dict = field(default_factory=dict)
    """Extra base models: name -> local Hugging Face directory."""
    threads: int = 0
    """Torch threads of the engine host (0: every core)."""
    persist_every: int = 1
    """Optimizer steps between durable model states (0: never; recovery then replays from creation)."""
    job_slots: int = 1
    """Jobs this worker's Ray node runs at once (the `lockstep_job_slots` resource)."""
    idle_poll_s: float = 0.25


def register_base_models(session, models: dict) -> None:
    """Record every base model the workers can load; `lockstep/tiny` always."""
    for name, path in models.items():
        cfg = json.loads((Path(path) / "config.json").read_text())
        session.merge(BaseModelEntry(name=name, path=str(Path(path).resolve()), arch=cfg.get("model_type", "unknown"),
                                     vocab_size=int(cfg["vocab_size"]),
                                     max_context_length=int(cfg.get("max_position_embeddings", 2048))))
    session.commit()


def _safe(model_id: str) -> str:
    return model_id.replace(":", "_")


class Worker:
    BATCH = 16

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.id = f"worker-{uuid.uuid4().hex[:12]}"
        self.engine, self.sessions = connect(config.db_url)
        self.storage = Storage(config.storage_url)
        self.sock = doorbell.bind()
        self.apis = doorbell.AddressBook(self.sessions, "api")
        self.loaded: set[str] = set()
        """Models known to be in the host (cleared when the host restarts)."""
        self.base_paths: dict[str, str] = {}
        """Base model name -> directory; registered once and never changed, so read once."""
        self.host = None
        self.scheduler: Scheduler | None = None
        self._stop = False

    # -- start-up --------------------------------------------------------------------------------
    def start(self) -> None:
        from lockstep.engine.tiny import ensure_tiny_model
        from lockstep.service.host import EngineHost

        home = Path(self.config.home)
        home.mkdir(parents=True, exist_ok=True)
        models = {BUILTIN_MODEL: str(ensure_tiny_model()), **self.config.models}
        with self.sessions() as s:
            register_base_models(s, models)
            doorbell.register(s, "worker", self.id, self.sock)
            requeued = queue.requeue_abandoned(s)
        if requeued:
            log.info("requeued %d requests left running by a previous worker", requeued)
        if not ray.is_initialized():
            if self.config.ray_address:
                ray.init(address=self.config.ray_address, log_to_driver=False)
            else:
                ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
                         configure_logging=False, resources={SLOT: self.config.job_slots},
                         runtime_env={"env_vars": {"MKL_CBWR": "AUTO,STRICT", "TOKENIZERS_PARALLELISM": "false"}})
        adopted = adopt_orphans(self.sessions)
        if adopted:
            log.info("requeued %d jobs a previous worker was running", adopted)
        address = self.config.ray_address or ray.get_runtime_context().gcs_address
        self.scheduler = Scheduler(self.sessions, self.storage, home, address)
        threads = self.config.threads or os.cpu_count() or 2
        # num_cpus=0: the host takes no Ray CPU slot, which the jobs' actors need; it sets its own threads.
        self.host = EngineHost.options(num_cpus=0, max_restarts=-1, max_task_retries=0).remote(
            self.config.storage_url, str(home / "cache"), threads)
        ray.get(self.host.ping.remote(), timeout=300)

    def stop(self) -> None:
        self._stop = True

    def serve_forever(self) -> None:
        next_tick = 0.0
        try:
            while not self._stop:
                if time.monotonic() >= next_tick:
                    self.scheduler.tick()
                    next_tick = time.monotonic() + 0.5
                if not self.step():
                    self._idle()
        finally:
            self.scheduler.shutdown()

    def _idle(self) -> None:
        ready, _, _ = select_mod.select([self.sock], [], [], self.config.idle_poll_s)
        if ready:
            try:
                while True:
                    self.sock.recv(64)
            except (BlockingIOError, socket.error):
                pass

    def step(self) -> bool:
        """Claim and run what is runnable now (up to a batch, so the scheduler still ticks under
        load); False when there was nothing."""
        for n in range(self.BATCH):
            with self.sessions() as s:
                req = queue.claim_next(s, self.id)
            if req is None:
                return n > 0
            self.run(req)
        return True

    # -- execution -------------------------------------------------------------------------------
    def run(self, req: queue.Claimed) -> None:
        t = time.perf_counter()
        try:
            result, fmt, usage, extra = self.execute(req)
        except (ServiceError, _UserError) as e:
            self._finish(req, error=str(e), category="user")
            return
        except ray.exceptions.RayActorError as e:
            log.warning("engine host died running %s (%s); it restarts and models are rebuilt", req.id, e)
            self._host_lost(req)
            return
        except Exception as e:  # noqa: BLE001 - report, never crash the worker
            from lockstep.service.host import HostError

            cause = getattr(e, "cause", None) or e
            if isinstance(cause, HostError):
                self._finish(req, error=str(cause), category="user")
            else:
                log.exception("request %s failed", req.id)
                self._finish(req, error=f"{type(cause).__name__}: {cause}", category="server")
            return
        usage[UsageKind.COMPUTE_SECONDS] = time.perf_counter() - t
        self._finish(req, result=result, fmt=fmt, usage=usage, extra=extra)

    def _finish(self, req: queue.Claimed, *, result: bytes | None = None, fmt: str = "json", error: str | None = None,
                category: str = "user", usage: dict | None = None, extra=None) -> None:
        with self.sessions() as s:
            if extra is not None:
                extra(s)
            rows = [{"tenant_id": req.tenant_id, "kind": kind.value, "amount": float(amount), "source": req.id}
                    for kind, amount in (usage or {}).items() if amount]
            if rows:
                s.execute(_INSERT_USAGE, rows)
            queue.finish(s, req.id, result=result, result_format=fmt, error=error, category=category)
        doorbell.ring(self.sock, self.apis.get(), req.id.encode())

    def _host_lost(self, req: queue.Claimed) -> None:
        self.loaded.clear()
        with self.sessions() as s:
            queue.requeue_abandoned(s, self.id)
        ray.get(self.host.ping.remote(), timeout=300)  # wait for Ray to restart it

    def _base_path(self, s, name: str) -> str:
        if name not in self.base_paths:
            entry = s.get(BaseModelEntry, name)
            if entry is None:
                raise _UserError(f"base model {name!r} is not registered on this worker")
            self.base_paths[name] = entry.path
        return self.base_paths[name]

    def execute(self, req: queue.Claimed):
        """-> (result bytes, format, usage, store update to commit with the result or None)."""
        kind = RequestKind(req.kind)
        if kind is RequestKind.SAMPLE:
            return self._sample(req)
        with self.sessions() as s:
            model = s.execute(_MODEL, {"mid": req.model_id}).first()
            if model is None:  # the API checks it exists; only a row deleted behind its back lacks one
                raise _UserError(f"unknown model_id {req.model_id!r}")
            base_path = self._base_path(s, model.base_model)
        if kind not in (RequestKind.CREATE_MODEL, RequestKind.LOAD_WEIGHTS) or req.seq_id != 0:
            self.ensure_model(model, base_path)
        return getattr(self, f"_{kind.value}")(req, model, base_path)

    def _call(self, ref):
        return ray.get(ref, timeout=3600)

    def _create_model(self, req, model, base_path):
        payload = json.loads(req.payload)
        out = self._call(self.host.create_model.remote(model.id, base_path, payload.get("lora_config")))
        self.loaded.add(model.id)
        return json.dumps(out).encode(), "json", {}, None

    def _load_weights(self, req, model, base_path):
        p = json.loads(req.payload)
        self._call(self.host.restore_state.remote(model.id, base_path, model.lora_config, p["storage_path"],
                                                  bool(p.get("optimizer"))))
        self.loaded.add(model.id)
        return json.dumps({"path": p["path"], "model_id": model.id, "type": "load_weights"}).encode(), "json", {}, None

    def _forward_backward(self, req, model, base_path, forward_only: bool = False):
        body, tokens = self._call(self.host.forward_backward.remote(model.id, req.payload, forward_only))
        usage = {} if forward_only else {UsageKind.TOKENS_TRAINED: tokens}
        return body, "proto", usage, None

    def _forward(self, req, model, base_path):
        return self._forward_backward(req, model, base_path, forward_only=True)

    def _optim_step(self, req, model, base_path):
        out = self._call(self.host.optim_step.remote(model.id, json.loads(req.payload)["adam_params"]))
        extra = None
        every = self.config.persist_every
        if every and int(out["metrics"].get("step:max", 0)) % every == 0:
            key = f"models/{_safe(model.id)}/state-{req.seq_id:08d}"
            self._call(self.host.save_state.remote(model.id, key, True))
            old = model.state_path

            def extra(s, key=key, old=old):
                row = s.get(Model, model.id)
                row.state_path, row.state_seq = key, req.seq_id
                if old and old != key:
                    self.storage.delete(old)

        return json.dumps(out).encode(), "json", {}, extra

    def _checkpoint_row(self, req, model, kind: str, name: str, key: str, size: int, meta: dict):
        def extra(s):
            ck = s.scalar(select(Checkpoint).where(Checkpoint.model_id == model.id, Checkpoint.kind == kind,
                                                   Checkpoint.name == name))
            if ck is None:
                ck = Checkpoint(tenant_id=model.tenant_id, model_id=model.id, kind=kind, name=name, storage_path=key)
                s.add(ck)
            ck.storage_path, ck.size_bytes, ck.created_at = key, size, now()
            ck.user_metadata = meta.get("user_metadata") or {}
            if meta.get("ttl_seconds"):
                import datetime as dt

                ck.expires_at = now() + dt.timedelta(seconds=int(meta["ttl_seconds"]))
        return extra

    def _save_weights(self, req, model, base_path):
        p = json.loads(req.payload)
        with self.sessions() as s:
            exists = s.scalar(select(Checkpoint).where(Checkpoint.model_id == model.id, Checkpoint.kind == "weights",
                                                       Checkpoint.name == p["name"])) is not None
        if exists and not p.get("overwrite"):
            raise _UserError(f"checkpoint weights/{p['name']} already exists for {model.id}; pass overwrite=True "
                             f"to replace it")
        key = f"checkpoints/{model.tenant_id}/{_safe(model.id)}/weights/{p['name']}"
        size = self._call(self.host.save_state.remote(model.id, key, True))
        path = f"tinker://{model.id}/weights/{p['name']}"
        return (json.dumps({"path": path, "type": "save_weights"}).encode(), "json", {},
                self._checkpoint_row(req, model, "weights", p["name"], key, size, p))

    def _save_weights_for_sampler(self, req, model, base_path):
        p = json.loads(req.payload)
        if p.get("name"):
            key = f"checkpoints/{model.tenant_id}/{_safe(model.id)}/sampler_weights/{p['name']}"
            size = self._call(self.host.save_state.remote(model.id, key, False))
            path = f"tinker://{model.id}/sampler_weights/{p['name']}"
            return (json.dumps({"path": path, "type": "save_weights_for_sampler"}).encode(), "json", {},
                    self._checkpoint_row(req, model, "sampler_weights", p["name"], key, size, p))
        ssid = f"{model.id}:sample:{p['sampling_session_seq_id']}"
        key = f"ephemeral/{model.tenant_id}/{_safe(ssid)}"
        self._call(self.host.snapshot_session.remote(model.id, ssid, key, base_path, model.lora_config))

        def extra(s):
            if s.get(SamplingSession, ssid) is None:
                s.add(SamplingSession(id=ssid, tenant_id=model.tenant_id, session_id=model.session_id,
                                      base_model=model.base_model, weights_path=key, lora_rank=model.lora_rank,
                                      lora_config=model.lora_config, vocab_size=model.vocab_size))

        return json.dumps({"sampling_session_id": ssid, "type": "save_weights_for_sampler"}).encode(), "json", {}, extra

    def _sample(self, req):
        with self.sessions() as s:
            ss = s.get(SamplingSession, req.sampling_session_id)
            if ss is None:  # the API checks it exists; only a row written behind its back lacks one
                raise _UserError(f"unknown sampling_session_id {req.sampling_session_id!r}")
            base_path = self._base_path(s, ss.base_model)
        if not self._call(self.host.has_session.remote(ss.id)):
            self._call(self.host.open_session.remote(ss.id, base_path, ss.lora_config, ss.weights_path))
        body, tokens = self._call(self.host.sample.remote(ss.id, json.loads(req.payload)))
        return body, "proto", {UsageKind.TOKENS_SAMPLED: tokens}, None

    # -- recovery --------------------------------------------------------------------------------
    def ensure_model(self, model, base_path: str) -> None:
        """Rebuild a model the host does not hold: its durable state, then a replay of the
        finished requests after it that change the model."""
        if model.id in self.loaded or self._call(self.host.has_model.remote(model.id)):
            self.loaded.add(model.id)
            return
        after = -1
        if model.state_path:
            self._call(self.host.restore_state.remote(model.id, base_path, model.lora_config, model.state_path, True))
            after = model.state_seq
        with self.sessions() as s:
            done = list(s.scalars(select(Request).where(
                Request.model_id == model.id, Request.state == RequestState.DONE.value, Request.seq_id > after,
                Request.seq_id <= model.done_seq, Request.kind.in_([k.value for k in RequestKind if k.changes_model]))
                .order_by(Request.seq_id)))
        log.info("rebuilding %s: state at seq %d, replaying %d requests", model.id, after, len(done))
        for r in done:
            kind = RequestKind(r.kind)
            if kind is RequestKind.CREATE_MODEL:
                self._create_model(r, model, base_path)
            elif kind is RequestKind.LOAD_WEIGHTS:
                self._load_weights(r, model, base_path)
            elif kind is RequestKind.FORWARD_BACKWARD:
                self._call(self.host.forward_backward.remote(model.id, r.payload, False))
            elif kind is RequestKind.OPTIM_STEP:
                self._call(self.host.optim_step.remote(model.id, json.loads(r.payload)["adam_params"]))
        self.loaded.add(model.id)


class _UserError(Exception):
    pass
