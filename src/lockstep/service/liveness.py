"""The Executor's liveness: it exits with its supervisor, renews its lease, and requeues the claims
of executors whose lease expired.

Ray keeps an orphaned actor alive for a while, and a new worker's start-up requeue must not race an
old executor still claiming, so a watchdog thread ends the process as soon as the supervisor is
gone; the same thread renews the lease (the endpoint's last_seen) that other executors' sweeps read.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import psutil

from lockstep.service import doorbell, queue
from lockstep.service.types import WORKER_LEASE_S

log = logging.getLogger("lockstep.executor")


class Liveness:
    WATCH_S = 0.2
    """How often the watchdog looks for the supervisor: an orphan must not claim for long."""
    HEARTBEAT_S = 2.0
    LEASE_S = WORKER_LEASE_S

    def __init__(self, sessions, worker_id: str, sock, max_attempts: int):
        self.sessions, self.id, self.sock, self.max_attempts = sessions, worker_id, sock, max_attempts
        self._next_sweep = 0.0

    def watch(self, supervisor_pid: int) -> None:
        """Start the watchdog thread (a daemon: it dies with the process)."""
        threading.Thread(target=self._watch, args=(psutil.Process(supervisor_pid),), daemon=True,
                         name="executor-watchdog").start()

    def _watch(self, supervisor: psutil.Process) -> None:
        """Exit with the supervisor; renew the lease meanwhile."""
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
                self.heartbeat()
                beat = time.monotonic() + self.HEARTBEAT_S
            time.sleep(self.WATCH_S)

    def heartbeat(self) -> None:
        try:
            with self.sessions() as s:
                doorbell.register(s, "worker", self.id, self.sock)  # renews last_seen, the lease
        except Exception as e:  # noqa: BLE001 - a store hiccup; the next beat retries, the lease is long
            log.warning("heartbeat failed: %s", e)

    def sweep(self) -> None:
        """Requeue the claims of executors that died mid-request after the start-up requeue (at
        most every third of a lease)."""
        if time.monotonic() < self._next_sweep:
            return
        self._next_sweep = time.monotonic() + self.LEASE_S / 3
        with self.sessions() as s:
            n = queue.requeue_expired(s, self.LEASE_S, self.max_attempts)
        if n:
            log.warning("requeued %d requests whose executor's lease expired", n)
