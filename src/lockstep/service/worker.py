"""The worker: a supervisor process (Ray, the job scheduler) and its Executor, the Ray actor that
hosts the engine, claims queued requests from the store, runs them and writes the results back.

Exactly-once effects across crashes: a model's state lives in the host's memory, and after every
`persist_every` optimizer steps it is also written to storage under a key versioned by seq_id, and
the store's pointer (state_path, state_seq) moves in the same transaction that finishes the
request. A fresh worker (or a restarted Executor) rebuilds a model lazily, on its next request: it
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
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from sqlalchemy import bindparam, insert, select

from lockstep.service import doorbell, queue
from lockstep.service.db import BaseModelEntry, Checkpoint, Model, Request, SamplingSession, Usage, connect, now
from lockstep.service.host import EngineHost, HostError
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
    """The node's supervisor: registers base models, starts (or joins) Ray, runs the job scheduler,
    and keeps one Executor actor claiming requests (Ray restarts it if it dies)."""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.id = f"worker-{uuid.uuid4().hex[:12]}"
        """Also the executor's: it survives the actor's restarts, so a restarted one finds its own claims."""
        self.engine, self.sessions = connect(config.db_url)
        self.storage = Storage(config.storage_url)
        self.executor = None
        self.scheduler: Scheduler | None = None
        self._stop = False

    def start(self) -> None:
        from lockstep.engine.tiny import ensure_tiny_model

        home = Path(self.config.home)
        home.mkdir(parents=True, exist_ok=True)
        models = {BUILTIN_MODEL: str(ensure_tiny_model()), **self.config.models}
        with self.sessions() as s:
            register_base_models(s, models)
            requeued = queue.requeue_abandoned(s)
        if requeued:
            log.info("requeued %d requests left running by a previous worker", requeued)
        if not ray.is_initialized():
            if self.config.ray_address:
                ray.init(address=self.config.ray_address, log_to_driver=True)
            else:
                ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=True,
                         configure_logging=False, resources={SLOT: self.config.job_slots},
                         runtime_env={"env_vars": {"MKL_CBWR": "AUTO,STRICT", "TOKENIZERS_PARALLELISM": "false"}})
        adopted = adopt_orphans(self.sessions)
        if adopted:
            log.info("requeued %d jobs a previous worker was running", adopted)
        address = self.config.ray_address or ray.get_runtime_context().gcs_address
        self.scheduler = Scheduler(self.sessions, self.storage, home, address)
        # On this node: the API rings it on loopback. num_cpus=0: it takes no Ray CPU slot, which the
        # jobs' actors need; it sets its own threads. Two threads of the actor: serve() and stop().
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.executor = Executor.options(num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=2,
                                         scheduling_strategy=here).remote(self.config, self.id, os.getpid())
        ray.get(self.executor.ready.remote(), timeout=300)

    def stop(self) -> None:
        self._stop = True

    def serve_forever(self) -> None:
        serving = self.executor.serve.remote()
        try:
            while not self._stop:
                self.scheduler.tick()
                done, _ = ray.wait([serving], timeout=0.5)
                if done:
                    serving = self._served(done[0])
        finally:
            self._shutdown(serving)

    def _served(self, ref):
        """The executor's serve() returned: it died (Ray restarts it, it requeues its own claims and
        rebuilds models lazily) or it was stopped; serve again unless we are stopping."""
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:
            log.warning("the executor died (%s); Ray restarts it and its requests are requeued", e)
        return self.executor.serve.remote()

    def _shutdown(self, serving) -> None:
        try:
            ray.get(self.executor.stop.remote(), timeout=10)
            ray.get(serving, timeout=60)  # the request in hand finishes first
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.warning("the executor did not stop cleanly: %s", e)
        self.scheduler.shutdown()


class RequestExecutor:
    """The Ray actor (`Executor`) that hosts the engine and runs queued requests: it claims them from the store,
    executes them on its in-process EngineHost and writes the results back. The engine lives in the
    same process as the claim loop, so a request costs no Ray call (BENCHMARKS.md §8)."""

    BATCH = 16
    WATCH_S = 0.2
    """How often the watchdog looks for the supervisor: an orphan must not claim for long."""
    HEARTBEAT_S = 2.0
    LEASE_S = 15.0
    """A claim whose executor has not renewed its endpoint's last_seen for this long is requeued."""

    def __init__(self, config: WorkerConfig, worker_id: str, supervisor_pid: int):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.config, self.id = config, worker_id
        _, self.sessions = connect(config.db_url)
        self.storage = Storage(config.storage_url)
        self.sock = doorbell.bind()
        self.apis = doorbell.AddressBook(self.sessions, "api")
        self.base_paths: dict[str, str] = {}
        """Base model name -> directory; registered once and never changed, so read once."""
        self.host = EngineHost(config.storage_url, str(Path(config.home) / "cache"),
                               config.threads or os.cpu_count() or 2)
        with self.sessions() as s:
            doorbell.register(s, "worker", self.id, self.sock)
            requeued = queue.requeue_abandoned(s, self.id)  # non-zero only after Ray restarted this actor
        if requeued:
            log.warning("restarted: requeued %d requests this executor had claimed", requeued)
        self._stop = False
        self._next_sweep = 0.0
        threading.Thread(target=self._watch, args=(psutil.Process(supervisor_pid),), daemon=True,
                         name="executor-watchdog").start()

    def _watch(self, supervisor: psutil.Process) -> None:
        """Exit with the supervisor (Ray keeps an orphaned actor alive for a while, and a new worker's
        start-up requeue must not race an old executor still claiming); renew the lease meanwhile."""
        beat = 0.0
        while True:
            try:
                alive = supervisor.is_running() and supervisor.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                log.warning("the supervisor (pid %d) is gone; exiting", supervisor.pid)
                os._exit(1)
            if time.monotonic() >= beat:
                self._heartbeat()
                beat = time.monotonic() + self.HEARTBEAT_S
            time.sleep(self.WATCH_S)

    def _heartbeat(self) -> None:
        try:
            with self.sessions() as s:
                doorbell.register(s, "worker", self.id, self.sock)  # renews last_seen, the lease
        except Exception as e:  # noqa: BLE001 - a store hiccup; the next beat retries, the lease is long
            log.warning("heartbeat failed: %s", e)

    def _sweep(self) -> None:
        """Requeue the claims of executors that died mid-request after the start-up requeue."""
        if time.monotonic() < self._next_sweep:
            return
        self._next_sweep = time.monotonic() + self.LEASE_S / 3
        with self.sessions() as s:
            n = queue.requeue_expired(s, self.LEASE_S)
        if n:
            log.warning("requeued %d requests whose executor's lease expired", n)

    def ready(self) -> bool:
        return True

    def stop(self) -> None:
        self._stop = True

    def serve(self) -> None:
        self._stop = False
        while not self._stop:
            self._sweep()
            if not self.step():
                self._idle()

    def _idle(self) -> None:
        ready, _, _ = select_mod.select([self.sock], [], [], self.config.idle_poll_s)
        if ready:
            try:
                while True:
                    self.sock.recv(64)
            except (BlockingIOError, socket.error):
                pass

    def step(self) -> bool:
        """Claim and run what is runnable now (up to a batch, so stop() is seen under load); False
        when there was nothing."""
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
        except (ServiceError, _UserError, HostError) as e:
            self._finish(req, error=str(e), category="user")
            return
        except Exception as e:  # noqa: BLE001 - report, never crash the executor
            log.exception("request %s failed", req.id)
            self._finish(req, error=f"{type(e).__name__}: {e}", category="server")
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
            mine = queue.finish(s, req.id, self.id, result=result, result_format=fmt, error=error, category=category)
        if not mine:  # requeued behind our back: its effect on the model in memory is not the store's
            log.warning("request %s was requeued while it ran here; its result is dropped", req.id)
            if req.model_id is not None:
                self.host.drop_model(req.model_id)
            return
        doorbell.ring(self.sock, self.apis.get(), req.id.encode())

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

    def _create_model(self, req, model, base_path):
        payload = json.loads(req.payload)
        out = self.host.create_model(model.id, base_path, payload.get("lora_config"))
        return json.dumps(out).encode(), "json", {}, None

    def _load_weights(self, req, model, base_path):
        p = json.loads(req.payload)
        self.host.restore_state(model.id, base_path, model.lora_config, p["storage_path"], bool(p.get("optimizer")))
        return json.dumps({"path": p["path"], "model_id": model.id, "type": "load_weights"}).encode(), "json", {}, None

    def _forward_backward(self, req, model, base_path, forward_only: bool = False):
        body, tokens = self.host.forward_backward(model.id, req.payload, forward_only)
        usage = {} if forward_only else {UsageKind.TOKENS_TRAINED: tokens}
        return body, "proto", usage, None

    def _forward(self, req, model, base_path):
        return self._forward_backward(req, model, base_path, forward_only=True)

    def _optim_step(self, req, model, base_path):
        out = self.host.optim_step(model.id, json.loads(req.payload)["adam_params"])
        extra = None
        every = self.config.persist_every
        if every and int(out["metrics"].get("step:max", 0)) % every == 0:
            key = f"models/{_safe(model.id)}/state-{req.seq_id:08d}"
            self.host.save_state(model.id, key, True)
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
        size = self.host.save_state(model.id, key, True)
        path = f"tinker://{model.id}/weights/{p['name']}"
        return (json.dumps({"path": path, "type": "save_weights"}).encode(), "json", {},
                self._checkpoint_row(req, model, "weights", p["name"], key, size, p))

    def _save_weights_for_sampler(self, req, model, base_path):
        p = json.loads(req.payload)
        if p.get("name"):
            key = f"checkpoints/{model.tenant_id}/{_safe(model.id)}/sampler_weights/{p['name']}"
            size = self.host.save_state(model.id, key, False)
            path = f"tinker://{model.id}/sampler_weights/{p['name']}"
            return (json.dumps({"path": path, "type": "save_weights_for_sampler"}).encode(), "json", {},
                    self._checkpoint_row(req, model, "sampler_weights", p["name"], key, size, p))
        ssid = f"{model.id}:sample:{p['sampling_session_seq_id']}"
        key = f"ephemeral/{model.tenant_id}/{_safe(ssid)}"
        self.host.snapshot_session(model.id, ssid, key, base_path, model.lora_config)

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
        if not self.host.has_session(ss.id):
            self.host.open_session(ss.id, base_path, ss.lora_config, ss.weights_path)
        body, tokens = self.host.sample(ss.id, json.loads(req.payload))
        return body, "proto", {UsageKind.TOKENS_SAMPLED: tokens}, None

    # -- recovery --------------------------------------------------------------------------------
    def ensure_model(self, model, base_path: str) -> None:
        """Rebuild a model the host does not hold: its durable state, then a replay of the
        finished requests after it that change the model."""
        if self.host.has_model(model.id):
            return
        after = -1
        if model.state_path:
            self.host.restore_state(model.id, base_path, model.lora_config, model.state_path, True)
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
                self.host.forward_backward(model.id, r.payload, False)
            elif kind is RequestKind.OPTIM_STEP:
                self.host.optim_step(model.id, json.loads(r.payload)["adam_params"])


# Decorated here, not on the class: Ray then pickles the class by reference (its module is
# importable), not by value with everything its methods touch (Core statements do not pickle).
Executor = ray.remote(RequestExecutor)


class _UserError(Exception):
    pass
