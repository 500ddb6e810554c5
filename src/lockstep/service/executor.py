"""The Executor: the Ray actor that hosts the engine, claims queued requests from the store, runs
them and writes the results back. The engine lives in the same process as the claim loop, so a
request costs no Ray call (BENCHMARKS.md §8).

Failing small. Whatever goes wrong while one request is handled (executing it, the store update
that goes with its result, its usage rows, finishing it, ringing the API) fails that request, with
a message, and nothing else; a failure of the claim loop itself (the store unreachable) is logged,
backed off and retried. A failed training request has no effect on its model: it advances the
model's order like any finished request, and an executor that may have applied part of it drops
the model from memory, which the replay below then rebuilds without it.

Exactly-once effects across crashes: a model's state lives in the host's memory, and after every
`persist_every` optimizer steps it is also written to storage under a new key, and the store's
pointer (state_path, state_seq) moves in the same transaction that finishes the request (the old
state is deleted only after that commit). A restarted executor, or one that dropped the model,
rebuilds it lazily, on its next request: it loads the pointed-to state and replays, in seq order,
the finished requests after it that change the model (their results were already delivered and are
not rewritten). Requests a dead executor had claimed go back to the queue, at most
`max_attempts` times each (see queue.py).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import select as select_mod
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import ray
from sqlalchemy import bindparam, insert, select

from lockstep.service import doorbell, janitor, queue
from lockstep.service.db import BaseModelEntry, Checkpoint, Model, Request, SamplingSession, Usage, now
from lockstep.service.db import connect
from lockstep.service.host import EngineHost, HostError
from lockstep.service.storage import Storage, unique_key
from lockstep.service.types import (WORKER_LEASE_S, RequestKind, RequestState, ServiceError, UsageKind,
                                    WorkerConfig)

log = logging.getLogger("lockstep.executor")
# Core, built once: these run on every request (see queue.py).
_MODEL = select(Model.__table__).where(Model.__table__.c.id == bindparam("mid"))
_INSERT_USAGE = insert(Usage.__table__)
MAX_TTL_S = 100 * 365 * 86400
"""Longest checkpoint time-to-live (100 years): beyond it the expiry date does not fit the store."""


class UserError(Exception):
    """A request that cannot be run as asked (the message goes back to the client)."""


@dataclass
class Outcome:
    """What executing a request produced, and what goes with committing it."""

    result: bytes
    fmt: str = "json"
    usage: dict = field(default_factory=dict)
    update: Callable | None = None
    """Store changes committed in the same transaction as the result (called with the session)."""
    after_commit: Callable[[], None] | None = None
    """Storage clean-up once the result is committed (an old state, a replaced save)."""
    on_abort: Callable[[], None] | None = None
    """Storage clean-up when the result is not committed (what this request wrote)."""


def _safe(model_id: str) -> str:
    return model_id.replace(":", "_")


def _json(req) -> dict:
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


class RequestExecutor:
    """The Ray actor (`Executor`) that runs queued requests on its in-process EngineHost."""

    BATCH = 16
    WATCH_S = 0.2
    """How often the watchdog looks for the supervisor: an orphan must not claim for long."""
    HEARTBEAT_S = 2.0
    LEASE_S = WORKER_LEASE_S
    MAX_BACKOFF_S = 10.0

    def __init__(self, config: WorkerConfig, worker_id: str, supervisor_pid: int):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.config, self.id = config, worker_id
        _, self.sessions = connect(config.db_url)
        self.storage = Storage(config.storage_url)
        self.sock = doorbell.bind()
        self.apis = doorbell.AddressBook(self.sessions, "api")
        self.base_paths: dict[str, str] = {}
        """Base model name -> directory; registered once and never changed, so read once."""
        self.host = EngineHost(config.storage_url, str(Path(config.home) / "cache"), config.threads or os.cpu_count() or 2,
                               max_models=config.max_models, max_sessions=config.max_sessions,
                               model_cache_bytes=config.model_cache_bytes,
                               fetch_cache_bytes=config.fetch_cache_bytes, speculative=config.speculative,
                               draft_tokens=config.draft_tokens, draft_timeout=config.draft_timeout_s,
                               device=config.device, dtype=config.dtype)
        with self.sessions() as s:
            doorbell.register(s, "worker", self.id, self.sock)
            # Non-zero only after Ray restarted this actor: what the dead one held.
            requeued = queue.requeue_abandoned(s, self.id, config.max_attempts)
        if requeued:
            log.warning("restarted: requeued %d requests this executor had claimed", requeued)
        self._stop = False
        self._next_sweep = 0.0
        self._in_hand: queue.Claimed | None = None
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
            n = queue.requeue_expired(s, self.LEASE_S, self.config.max_attempts)
        if n:
            log.warning("requeued %d requests whose executor's lease expired", n)

    def ready(self) -> bool:
        return True

    def stop(self) -> None:
        self._stop = True

    def serve(self) -> None:
        """Claim and run until stopped. A failure outside any one request's handling (the store
        unreachable, say) is logged and retried with a growing pause; it never ends the loop."""
        self._stop = False
        pause = 0.0
        while not self._stop:
            try:
                self._sweep()
                busy = self.step()
                pause = 0.0
            except Exception:  # noqa: BLE001 - the loop must outlive any one failure
                pause = min(max(2 * pause, 0.5), self.MAX_BACKOFF_S)
                log.exception("the claim loop failed; retrying in %.1f s", pause)
                self._release_in_hand()
                self._sleep(pause)
                continue
            if not busy:
                self._idle()

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self._stop and time.monotonic() < end:
            time.sleep(min(0.2, end - time.monotonic()))

    def _release_in_hand(self) -> None:
        """After a failure outside a request's own handling: the request in hand (if any) goes back
        to the queue (it counts as an attempt) and its model, maybe part-changed, is dropped."""
        req, self._in_hand = self._in_hand, None
        if req is None:
            return
        self._forget(req)
        try:
            with self.sessions() as s:
                queue.requeue_abandoned(s, self.id, self.config.max_attempts)
        except Exception as e:  # noqa: BLE001 - still unreachable: the lease sweep or a restart requeues it
            log.warning("could not requeue request %s yet: %s", req.id, e)

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
            self._in_hand = req
            self.run(req)
            self._in_hand = None
        return True

    # -- one request -----------------------------------------------------------------------------
    def run(self, req: queue.Claimed) -> None:
        """Execute, commit, ring: a failure at any point fails this request and nothing else."""
        t = time.perf_counter()
        try:
            out = self.execute(req)
        except (ServiceError, UserError, HostError) as e:
            self._fail(req, str(e), "user")
            return
        except Exception as e:  # noqa: BLE001 - report, never crash the executor
            log.exception("request %s (%s) failed", req.id, req.kind)
            self._forget(req)
            self._fail(req, f"internal error running {req.kind}: {type(e).__name__}: {e}", "server")
            return
        out.usage[UsageKind.COMPUTE_SECONDS] = time.perf_counter() - t
        try:
            mine = self._commit(req, out)
        except Exception as e:  # noqa: BLE001 - e.g. a value the store refuses: this request fails
            log.exception("request %s (%s): recording its result failed", req.id, req.kind)
            self._aborted(req, out)
            self._fail(req, f"internal error recording the result of {req.kind}: {type(e).__name__}: {e}", "server")
            return
        if not mine:  # requeued behind our back: its effect on the model in memory is not the store's
            log.warning("request %s was requeued while it ran here; its result is dropped", req.id)
            self._aborted(req, out)
            return
        self._after(req, out.after_commit)
        self._ring(req)

    def _commit(self, req: queue.Claimed, out: Outcome) -> bool:
        with self.sessions() as s:
            if out.update is not None:
                out.update(s)
            rows = [{"tenant_id": req.tenant_id, "kind": kind.value, "amount": float(amount), "source": req.id}
                    for kind, amount in out.usage.items() if amount]
            if rows:
                s.execute(_INSERT_USAGE, rows)
            return queue.finish(s, req.id, self.id, result=out.result, result_format=out.fmt)

    def _fail(self, req: queue.Claimed, error: str, category: str) -> None:
        """Record the failure alone (a fresh transaction); a store that refuses even this is a
        claim-loop failure (the request goes back to the queue when the loop recovers)."""
        with self.sessions() as s:
            mine = queue.finish(s, req.id, self.id, error=error, category=category)
        if mine:
            self._ring(req)

    def _aborted(self, req: queue.Claimed, out: Outcome) -> None:
        self._forget(req)
        self._after(req, out.on_abort)

    def _forget(self, req: queue.Claimed) -> None:
        """The model in memory may hold an effect the store does not: rebuild it on its next request."""
        if req.model_id is not None and RequestKind(req.kind) is not RequestKind.SAMPLE:
            self.host.drop_model(req.model_id)

    def _after(self, req: queue.Claimed, cleanup: Callable[[], None] | None) -> None:
        if cleanup is None:
            return
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - only storage is left behind; the request's outcome stands
            log.exception("request %s: storage clean-up failed", req.id)

    def _ring(self, req: queue.Claimed) -> None:
        try:
            doorbell.ring(self.sock, self.apis.get(), req.id.encode())
        except Exception as e:  # noqa: BLE001 - the API's fallback poll finds the result anyway
            log.warning("could not ring the API for request %s: %s", req.id, e)

    # -- execution -------------------------------------------------------------------------------
    def _base_path(self, s, name: str) -> str:
        if name not in self.base_paths:
            entry = s.get(BaseModelEntry, name)
            if entry is None:
                raise UserError(f"base model {name!r} is not registered on this worker")
            self.base_paths[name] = entry.path
        return self.base_paths[name]

    def execute(self, req: queue.Claimed) -> Outcome:
        kind = RequestKind(req.kind)
        if kind is RequestKind.SAMPLE:
            return self._sample(req)
        with self.sessions() as s:
            model = s.execute(_MODEL, {"mid": req.model_id}).first()
            if model is None:  # the API checks it exists; only a row deleted behind its back lacks one
                raise UserError(f"unknown model_id {req.model_id!r}")
            base_path = self._base_path(s, model.base_model)
        if kind not in (RequestKind.CREATE_MODEL, RequestKind.LOAD_WEIGHTS) or req.seq_id != 0:
            self.ensure_model(model, base_path)
        return HANDLERS[kind](self, req, model, base_path)

    def _create_model(self, req, model, base_path) -> Outcome:
        lora = _json(req).get("lora_config")
        out = self.host.create_model(model.id, base_path, lora if isinstance(lora, dict) else None)
        return Outcome(json.dumps(out).encode())

    def _load_weights(self, req, model, base_path) -> Outcome:
        p = _json(req)
        self.host.restore_state(model.id, base_path, model.lora_config, p["storage_path"], bool(p.get("optimizer")))
        out = Outcome(json.dumps({"path": p["path"], "model_id": model.id, "type": "load_weights"}).encode())
        if self.config.persist_every:  # the model's durable state must not depend on a checkpoint its owner may delete
            self._persist(req, model, out)
        return out

    def _forward_backward(self, req, model, base_path, forward_only: bool = False) -> Outcome:
        body, tokens = self.host.forward_backward(model.id, req.payload, forward_only)
        return Outcome(body, "proto", {} if forward_only else {UsageKind.TOKENS_TRAINED: tokens})

    def _forward(self, req, model, base_path) -> Outcome:
        return self._forward_backward(req, model, base_path, forward_only=True)

    def _optim_step(self, req, model, base_path) -> Outcome:
        adam = _json(req).get("adam_params")
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
        key = unique_key(f"models/{_safe(model.id)}", f"state-{req.seq_id:08d}")
        self.host.save_state(model.id, key, True)

        def update(s):
            row = s.get(Model, model.id)
            row.state_path, row.state_seq = key, req.seq_id

        out.update = update
        out.after_commit = (lambda: self._delete_unreferenced(model.state_path)) if model.state_path else None
        out.on_abort = lambda: self._delete_unreferenced(key)

    def _save(self, req, model, kind: str, optimizer: bool) -> Outcome:
        """A named save (weights/<name> or sampler_weights/<name>): a new key each time; a re-used
        name then points at it, and the copy it replaced is deleted unless a sampler is pinned to it."""
        p = _json(req)
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
        key = unique_key(f"checkpoints/{model.tenant_id}/{_safe(model.id)}", f"{kind}/{name}")
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

    def _save_weights_for_sampler(self, req, model, base_path) -> Outcome:
        p = _json(req)
        if p.get("name"):
            return self._save(req, model, "sampler_weights", optimizer=False)
        seq = p.get("sampling_session_seq_id")
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise UserError("save_weights_for_sampler needs a name or an integer sampling_session_seq_id")
        ssid = f"{model.id}:sample:{seq}"
        key = unique_key(f"ephemeral/{model.tenant_id}", _safe(ssid))
        self.host.snapshot_session(model.id, ssid, key, base_path, model.lora_config)

        def update(s):
            if s.get(SamplingSession, ssid) is None:
                s.add(SamplingSession(id=ssid, tenant_id=model.tenant_id, session_id=model.session_id,
                                      base_model=model.base_model, weights_path=key, lora_rank=model.lora_rank,
                                      lora_config=model.lora_config, vocab_size=model.vocab_size))

        return Outcome(json.dumps({"sampling_session_id": ssid, "type": "save_weights_for_sampler"}).encode(),
                       update=update, on_abort=lambda: self._delete_unreferenced(key))

    def _sample(self, req) -> Outcome:
        with self.sessions() as s:
            ss = s.get(SamplingSession, req.sampling_session_id)
            if ss is None:  # the API checks it exists; only a row deleted behind its back (expired) lacks one
                raise UserError(f"unknown sampling_session_id {req.sampling_session_id!r}")
            base_path = self._base_path(s, ss.base_model)
        if not self.host.has_session(ss.id):
            self.host.open_session(ss.id, base_path, ss.lora_config, ss.weights_path)
        body, tokens = self.host.sample(ss.id, _json(req))
        return Outcome(body, "proto", {UsageKind.TOKENS_SAMPLED: tokens})

    # -- recovery --------------------------------------------------------------------------------
    def ensure_model(self, model, base_path: str) -> None:
        """Rebuild a model the host does not hold: its durable state, then a replay of the
        finished requests after it that change the model. A rebuild that fails part-way leaves
        nothing behind (the next request starts over)."""
        if self.host.has_model(model.id):
            return
        try:
            self._rebuild(model, base_path)
        except BaseException:
            self.host.drop_model(model.id)
            raise

    def _rebuild(self, model, base_path: str) -> None:
        after = -1
        if model.state_path:
            self.host.restore_state(model.id, base_path, model.lora_config, model.state_path, True)
            after = model.state_seq
        with self.sessions() as s:
            done = list(s.scalars(select(Request).where(
                Request.model_id == model.id, Request.state == RequestState.DONE.value, Request.seq_id > after,
                Request.seq_id <= model.done_seq, Request.kind.in_([k.value for k in REPLAY]))
                .order_by(Request.seq_id)))
        log.info("rebuilding %s: state at seq %d, replaying %d requests", model.id, after, len(done))
        for r in done:
            kind = RequestKind(r.kind)
            if not self.host.has_model(model.id) and kind not in (RequestKind.CREATE_MODEL, RequestKind.LOAD_WEIGHTS):
                break
            REPLAY[kind](self, r, model, base_path)
        if not self.host.has_model(model.id):
            raise UserError(f"model {model.id} does not exist: the request that created it failed")


HANDLERS: dict[RequestKind, Callable[..., Outcome]] = {
    RequestKind.CREATE_MODEL: RequestExecutor._create_model,
    RequestKind.LOAD_WEIGHTS: RequestExecutor._load_weights,
    RequestKind.FORWARD_BACKWARD: RequestExecutor._forward_backward,
    RequestKind.FORWARD: RequestExecutor._forward,
    RequestKind.OPTIM_STEP: RequestExecutor._optim_step,
    RequestKind.SAVE_WEIGHTS: RequestExecutor._save_weights,
    RequestKind.SAVE_WEIGHTS_FOR_SAMPLER: RequestExecutor._save_weights_for_sampler,
}
"""Training request kind -> handler (sampling requests, which have no model, go to _sample)."""
assert set(HANDLERS) == set(RequestKind) - {RequestKind.SAMPLE}

REPLAY: dict[RequestKind, Callable] = {
    RequestKind.CREATE_MODEL: RequestExecutor._create_model,
    RequestKind.LOAD_WEIGHTS: lambda ex, r, model, base: ex.host.restore_state(
        model.id, base, model.lora_config, json.loads(r.payload)["storage_path"], bool(json.loads(r.payload).get("optimizer"))),
    RequestKind.FORWARD_BACKWARD: lambda ex, r, model, base: ex.host.forward_backward(model.id, r.payload, False),
    RequestKind.OPTIM_STEP: lambda ex, r, model, base: ex.host.optim_step(model.id, json.loads(r.payload)["adam_params"]),
}
"""How a finished request's effect is re-applied when its model is rebuilt (its result is kept)."""
assert set(REPLAY) == {k for k in RequestKind if k.changes_model}

# Decorated here, not on the class: Ray then pickles the class by reference (its module is
# importable), not by value with everything its methods touch (Core statements do not pickle).
Executor = ray.remote(RequestExecutor)
