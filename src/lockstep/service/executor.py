"""The Executor: the Ray actor that hosts the engine, claims queued requests from the store, runs
them and writes the results back. The engine lives in the same process as the claim loop, so a
request costs no Ray call (BENCHMARKS.md §8).

This module is the claim loop; the Executor's other roles are their own units:

    packing.py    which queued requests run together (a batch), fairly between tenants
    liveness.py   exits with the supervisor, renews the lease, requeues expired claims
    handlers.py   what each request kind does on the EngineHost (host.py) -> an Outcome
    recovery.py   rebuilds a model the host does not hold (durable state + replay)
    commit.py     an Outcome or an error -> the request's row, one request per transaction

A request flows: claim (packing.Packer: a batch formed from the store's heads, claimed in one
compare-and-set) -> handlers (each member readied, then the batch run by the host in one call) ->
commit (each member alone).

Failing small. Whatever goes wrong while one request is handled (executing it, the store update
that goes with its result, its usage rows, finishing it, ringing the API) fails that request, with
a message, and nothing else; a failure of the claim loop itself (the store unreachable) is logged,
backed off and retried, and the requests in hand go back to the queue. A failed training request
has no effect on its model: it advances the model's order like any finished request, and an
executor that may have applied part of it drops the model from memory, which recovery then rebuilds
without it. Requests a dead executor had claimed go back to the queue, at most `max_attempts`
times each (see queue.py).
"""

from __future__ import annotations

import logging
import os
import select as select_mod
import socket
import time
from pathlib import Path

import ray

from lockstep.service import doorbell, queue
from lockstep.service.commit import CommitProtocol
from lockstep.service.db import connect
from lockstep.service.handlers import Handlers
from lockstep.service.host import EngineHost
from lockstep.service.liveness import Liveness
from lockstep.service.packing import Claim, Packer
from lockstep.service.policy import Policy, from_env
from lockstep.service.recovery import Recovery
from lockstep.service.storage import Storage
from lockstep.service.types import UsageKind, WorkerConfig

log = logging.getLogger("lockstep.executor")


class RequestExecutor:
    """The Ray actor (`Executor`) that runs queued requests on its in-process EngineHost."""

    BATCH = 16
    """Batches run per step (so stop() is seen under load)."""
    MAX_BACKOFF_S = 10.0

    def __init__(self, config: WorkerConfig, worker_id: str, supervisor_pid: int, policy: Policy | None = None):
        """policy: the operator's (its tenants' batch weights); None: $LOCKSTEP_POLICY's."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.config, self.id = config, worker_id
        _, self.sessions = connect(config.db_url)
        self.sock = doorbell.bind()
        self.host = EngineHost(config.storage_url, str(Path(config.home) / "cache"), config.threads or os.cpu_count() or 2,
                               max_models=config.max_models, max_sessions=config.max_sessions,
                               model_cache_bytes=config.model_cache_bytes,
                               fetch_cache_bytes=config.fetch_cache_bytes, speculative=config.speculative,
                               draft_tokens=config.draft_tokens, draft_timeout=config.draft_timeout_s,
                               device=config.device, dtype=config.dtype)
        self.recovery = Recovery(self.host, self.sessions)
        self.handlers = Handlers(self.host, self.sessions, Storage(config.storage_url), config,
                                 self.recovery.ensure_model)
        self.commit = CommitProtocol(self.sessions, self.id, self.host, self.sock,
                                     doorbell.AddressBook(self.sessions, "api"))
        self.liveness = Liveness(self.sessions, self.id, self.sock, config.max_attempts)
        policy = policy if policy is not None else from_env()
        # At most what the host holds at once: readying a member must not evict another.
        self.packer = Packer(config.max_batch_tokens, lambda tenant: policy.for_tenant(tenant).batch_weight,
                             max_members=min(config.max_models, config.max_sessions))
        with self.sessions() as s:
            doorbell.register(s, "worker", self.id, self.sock)
            # Non-zero only after Ray restarted this actor: what the dead one held.
            requeued = queue.requeue_abandoned(s, self.id, config.max_attempts)
        if requeued:
            log.warning("restarted: requeued %d requests this executor had claimed", requeued)
        self._stop = False
        self._in_hand: tuple[queue.Claimed, ...] = ()
        self.liveness.watch(supervisor_pid)

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
                self.liveness.sweep()
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
        """After a failure outside a request's own handling: the requests in hand not yet settled go
        back to the queue (it counts as an attempt) and their models, maybe part-changed, are dropped."""
        held, self._in_hand = self._in_hand, ()
        if not held:
            return
        for req in held:
            self.commit.forget(req)
        try:
            with self.sessions() as s:
                queue.requeue_abandoned(s, self.id, self.config.max_attempts)
        except Exception as e:  # noqa: BLE001 - still unreachable: the lease sweep or a restart requeues them
            log.warning("could not requeue requests %s yet: %s", [r.id for r in held], e)

    def _idle(self) -> None:
        ready, _, _ = select_mod.select([self.sock], [], [], self.config.idle_poll_s)
        if ready:
            try:
                while True:
                    self.sock.recv(64)
            except (BlockingIOError, socket.error):
                pass

    def step(self) -> bool:
        """Claim and run what is runnable now (up to BATCH batches); False when there was nothing."""
        for n in range(self.BATCH):
            with self.sessions() as s:
                claim = self.packer.claim(s, self.id)
            if claim is None:
                return n > 0
            self._in_hand = claim.members
            self.run(claim)
            self._in_hand = ()
        return True

    def run(self, claim: Claim) -> None:
        """Execute a batch, then commit and ring each member alone: a failure at any point fails
        that member and nothing else."""
        t = time.perf_counter()
        try:
            results = self.handlers.execute_batch(claim.members)
        except Exception as e:  # noqa: BLE001 - report, never crash the executor
            results = [e] * len(claim.members)
        seconds = self.packer.charge(claim, time.perf_counter() - t)
        for req, out in zip(claim.members, results):
            if isinstance(out, Exception):
                self.commit.failed(req, out)
            else:
                out.usage[UsageKind.COMPUTE_SECONDS] = seconds[req.id]
                self.commit.settle(req, out)


# Decorated here, not on the class: Ray then pickles the class by reference (its module is
# importable), not by value with everything its methods touch (Core statements do not pickle).
Executor = ray.remote(RequestExecutor)
