"""What feeds the job event streams (`GET /v1/jobs/ID/events`) of one API process: one change
notifier for all of them, shared reads, and the caps on how many are open.

Each stream used to read the store every 0.5 s on its own: 1,500 streams of one tenant were
3,000 queries a second, and another tenant's SDK session took 79 s instead of 3. Now:

- `JobNotifier`: one task per API process reads the ids of job events newer than the last it saw
  (one indexed query per `event_poll_s`, whatever the number of streams) and wakes the streams
  waiting on the jobs that changed (doorbell.Waiters). The events' writers are mostly in the
  worker's process (the scheduler), so the store is the signal; a stream reads the store only when
  woken.
- `SharedReads`: the streams of one job at one position (every follower of a job, once caught up)
  share one read of the store, a few at a time, so streams never take the thread pool that every
  other request needs.
- `StreamSlots`: open streams per tenant and in all, against the operator's caps
  (`max_event_streams`, `max_event_streams_total`); one over a cap is a 429 naming it.

Event ids come from the store's sequence. A writer's transaction can commit after one that took a
later id (PostgreSQL; SQLite serialises writers), so an id below the newest seen can still appear:
the notifier keeps such holes for `SETTLE_S` and wakes the job when one fills.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from typing import Callable

from sqlalchemy import func, or_, select
from starlette.concurrency import run_in_threadpool

from lockstep.service import doorbell
from lockstep.service.db import JobEvent
from lockstep.service.types import QuotaExceeded

log = logging.getLogger("lockstep.service.notifier")

SETTLE_S = 120.0
"""How long an id missing below the newest is waited for (an open transaction's event) before it
counts as rolled back."""
MAX_GAPS = 4096
"""Missing ids remembered at once (each rolled-back insert leaves one until SETTLE_S)."""
MAX_ROWS = 10_000
"""New event ids one poll reads; the rest come at the next poll."""
MAX_READS = 4
"""Stream reads of the store running at once (the thread pool is shared with every request)."""


class JobNotifier:
    """Wakes the streams of jobs that have new events. `start()` in the app's lifespan (it reads
    the newest id first, before any stream can read), `stop()` at its end."""

    def __init__(self, sessions, every_s: float):
        self.sessions, self.every_s = sessions, every_s
        self.waiters = doorbell.Waiters()
        """Job id -> the events its streams wait on."""
        self.reads = SharedReads()
        self.woken_at: dict[str, int] = {}
        """Job id -> the read clock when its streams were last woken (jobs with streams only)."""
        self._last: int | None = None
        self._gaps: dict[int, float] = {}
        """Ids below `_last` not seen yet -> when first missed (monotonic)."""
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await run_in_threadpool(self.poll)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="job-notifier")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                self.wake(await run_in_threadpool(self.poll))
                failures = 0
            except Exception:  # the store unreachable: streams wait (keep-alives go on), then retry
                failures += 1
                log.exception("job notifier: reading new events failed (%d in a row)", failures)
            await asyncio.sleep(min(self.every_s * 2 ** min(failures, 10), 10.0))

    def wake(self, job_ids: set[str]) -> None:
        self.woken_at = {j: t for j, t in self.woken_at.items() if j in self.waiters}
        for job_id in job_ids:
            if job_id in self.waiters:
                self.woken_at[job_id] = self.reads.stamp()
                self.waiters.wake(job_id)

    def since(self, job_id: str, woken: bool) -> int:
        """The read clock a stream's next read must start after: when the notifier woke its job
        (any event committed before that is in a read started later), or now if it was not woken.
        Call it when registering the stream's next wait, with no await between."""
        return self.woken_at.get(job_id, self.reads.stamp()) if woken else self.reads.stamp()

    def poll(self) -> set[str]:
        """The jobs with events committed since the last poll (the first poll only takes the newest
        id). One poll at a time: only the notifier's task calls it, in a thread."""
        with self.sessions() as s:
            if self._last is None:
                self._last = s.scalar(select(func.coalesce(func.max(JobEvent.id), 0)))
                return set()
            newer = JobEvent.id > self._last
            where = or_(newer, JobEvent.id.in_(list(self._gaps))) if self._gaps else newer
            rows = s.execute(select(JobEvent.id, JobEvent.job_id).where(where).order_by(JobEvent.id)
                             .limit(MAX_ROWS)).all()
        return self.account(rows, time.monotonic())

    def account(self, rows, now: float) -> set[str]:
        """Take (id, job_id) rows in: fill holes, record new ones, expire old ones."""
        self._gaps = {i: t for i, t in self._gaps.items() if now - t < SETTLE_S}
        ids = {i for i, _ in rows}
        for i in ids:
            self._gaps.pop(i, None)
        newest = max(ids, default=self._last)
        if newest > self._last:
            for i in range(max(self._last + 1, newest - MAX_GAPS), newest):
                if i not in ids:
                    self._gaps[i] = now
            self._last = newest
        if len(self._gaps) > MAX_GAPS:  # the oldest holes are the likeliest rolled back
            self._gaps = dict(sorted(self._gaps.items())[-MAX_GAPS:])
        return {job_id for _, job_id in rows}


class SharedReads:
    """One read of the store for all the streams of a job at one position. A stream may join a read
    only if it started after `since` (JobNotifier.since): an older read could have missed the event
    that woke the stream. Streams woken together share the first one's read."""

    def __init__(self, concurrency: int = MAX_READS):
        self._slots = asyncio.Semaphore(concurrency)
        self._clock = itertools.count()
        self._reads: dict[tuple, tuple[int, asyncio.Task]] = {}

    def stamp(self) -> int:
        return next(self._clock)

    async def read(self, key: tuple, since: int, fn: Callable[[], object]):
        entry = self._reads.get(key)
        if entry is None or entry[0] <= since:
            entry = (next(self._clock), asyncio.ensure_future(self._run(fn)))
            self._reads[key] = entry
            entry[1].add_done_callback(lambda task: self._done(key, entry))
        return await asyncio.shield(entry[1])  # a stream that goes away does not cancel the others' read

    async def _run(self, fn: Callable[[], object]):
        async with self._slots:
            return await run_in_threadpool(fn)

    def _done(self, key: tuple, entry: tuple[int, asyncio.Task]) -> None:
        if self._reads.get(key) is entry:
            del self._reads[key]
        if not entry[1].cancelled():
            entry[1].exception()  # retrieved here too: every sharer may have gone


class StreamSlots:
    """Open event streams per tenant and in all. Used only on the event loop, so no lock."""

    def __init__(self):
        self.by_tenant: Counter[str] = Counter()
        self.total = 0

    def acquire(self, tenant_id: str, tenant_name: str, *, cap: int, total_cap: int) -> Callable[[], None]:
        """Take a slot, or QuotaExceeded (429) naming the cap; returns the slot's release (idempotent)."""
        if self.by_tenant[tenant_id] >= cap:
            raise QuotaExceeded(f"tenant {tenant_name!r} has {self.by_tenant[tenant_id]} event streams open "
                                f"(max_event_streams = {cap}); close one, or follow fewer jobs at once")
        if self.total >= total_cap:
            raise QuotaExceeded(f"this server has {self.total} event streams open (max_event_streams_total = "
                                f"{total_cap}); retry later")
        self.by_tenant[tenant_id] += 1
        self.total += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.by_tenant[tenant_id] -= 1
                if not self.by_tenant[tenant_id]:
                    del self.by_tenant[tenant_id]
                self.total -= 1
        return release
