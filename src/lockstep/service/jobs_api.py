"""Native jobs under /v1: submit a declarative RLTask (the `lockstep run` spec, as JSON), follow
it, cancel it, read its logs, download its artifacts; datasets for its data files (datasets.py);
and per-tenant usage. Auth: `Authorization: Bearer <key>` or `X-API-Key`.

Every spec passes the operator's policy (policy.py) before it is stored. A job id may be given
as any unique prefix of it; another tenant's job is unknown, whatever the prefix.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import tarfile
import time
import uuid
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select
from starlette.concurrency import run_in_threadpool

from lockstep.service import datasets
from lockstep.service.bodies import PRINTABLE
from lockstep.service.deps import db, tenant_of
from lockstep.service.datasets import limits_of
from lockstep.service.db import Dataset, Job, JobEvent, Tenant, Usage, now
from lockstep.service.jobstate import move
from lockstep.service.policy import Limits, Policy, check_spec, final_model_key, resolve
from lockstep.service.types import JobState, NotFound, Priority, QuotaExceeded, ServiceError, UsageKind

router = APIRouter()
router.include_router(datasets.router)
TENANT = Depends(tenant_of)
ARTIFACTS = {"report.html": "text/html", "summary.json": "application/json", "metrics.jsonl": "application/x-ndjson",
             "config.json": "application/json"}
JOB_ID = re.compile(r"[0-9a-f]{1,64}")
MAX_ID = 2**63 - 1
"""Largest event id (SQLite and PostgreSQL integers are signed 64-bit)."""
CHUNK = 1 << 20


class Submit(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: dict[str, Any]
    """A RunSpec as JSON (what `lockstep run --dry-run` prints under "config", or a TOML's tables)."""
    name: str = Field("", max_length=128, pattern=PRINTABLE)
    priority: Priority = Priority.PREEMPTIBLE
    max_attempts: int = Field(3, ge=1, le=10)


def validate_spec(s, tenant: Tenant, spec: dict, limits: Limits) -> dict:
    """The full config validation of `lockstep run`, the operator's policy and the spec's
    references (the tenant's own datasets and models), before anything is stored."""
    from lockstep.config import to_dict

    d = to_dict(check_spec(spec, limits))
    resolve(s, tenant.id, d)
    return d


def _job_json(job: Job) -> dict:
    return {"id": job.id, "name": job.name, "state": job.state, "priority": job.priority, "attempts": job.attempts,
            "max_attempts": job.max_attempts, "preemptions": job.preemptions, "interruptions": job.interruptions,
            "error": job.error,
            "summary": job.summary, "run_seconds": job.run_seconds, "created_at": job.created_at.isoformat(),
            "started_at": job.started_at.isoformat() if job.started_at else None,
            "finished_at": job.finished_at.isoformat() if job.finished_at else None, "spec": job.spec}


def _job(s, t: Tenant, job_id: str) -> Job:
    """The tenant's job with this id, or with this unique id prefix."""
    if not JOB_ID.fullmatch(job_id):
        raise NotFound(f"unknown job {job_id[:100]!r}")
    job = s.get(Job, job_id)
    if job is not None and job.tenant_id == t.id:
        return job
    ids = list(s.scalars(select(Job.id).where(Job.tenant_id == t.id, Job.id.startswith(job_id)).limit(6)))
    if not ids:
        raise NotFound(f"unknown job {job_id!r}")
    if len(ids) > 1:
        shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
        raise ServiceError(f"job id prefix {job_id!r} matches {'more than 5' if len(ids) > 5 else len(ids)} of your "
                           f"jobs ({shown}); give more of the id")
    return s.get(Job, ids[0])


@router.post("/jobs")
def submit_job(body: Submit, request: Request, t: Tenant = TENANT) -> dict:
    limits = limits_of(request, t)
    with db(request) as s:
        spec = validate_spec(s, t, body.spec, limits)
        job = Job(id=uuid.uuid4().hex[:16], tenant_id=t.id, name=body.name, spec=spec, priority=body.priority.value,
                  max_attempts=body.max_attempts, state=JobState.QUEUED.value)
        # Inserted before counting: the INSERT takes SQLite's write lock (the tenant row lock,
        # PostgreSQL's), so concurrent submissions cannot all pass the queue cap.
        s.execute(select(Tenant.id).where(Tenant.id == t.id).with_for_update())
        s.add(job)
        s.add(JobEvent(job_id=job.id, kind="state", data={"state": job.state}))
        s.flush()
        waiting = s.scalar(select(func.count()).select_from(Job).where(Job.tenant_id == t.id,
                                                                       Job.state == JobState.QUEUED.value))
        if waiting > limits.max_queued_jobs:
            raise QuotaExceeded(f"tenant {t.name!r} has {waiting - 1} jobs waiting (max_queued_jobs = "
                                f"{limits.max_queued_jobs})")
        s.commit()
        return _job_json(job)


@router.get("/jobs")
def list_jobs(request: Request, t: Tenant = TENANT, state: JobState | None = None,
              limit: int = Query(500, ge=1, le=5000)) -> dict:
    """The tenant's newest `limit` jobs (in `state`, if given), oldest first."""
    with db(request) as s:
        q = select(Job).where(Job.tenant_id == t.id)
        if state:
            q = q.where(Job.state == state.value)
        jobs = list(s.scalars(q.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)))
        latest = latest_metrics(s, [j.id for j in jobs])
        return {"jobs": [{**_job_json(j), "latest": latest.get(j.id)} for j in reversed(jobs)]}


LATEST_KEYS = ("rollout/reward_mean", "rollout/accuracy", "eval/accuracy")


def latest_metrics(s, job_ids: list[str]) -> dict[str, dict]:
    """Each job's newest metrics record, cut to its step and the reward and accuracy keys (two
    queries, whatever the number of jobs)."""
    if not job_ids:
        return {}
    newest = select(func.max(JobEvent.id)).where(JobEvent.job_id.in_(job_ids), JobEvent.kind == "metrics")
    rows = s.execute(select(JobEvent.job_id, JobEvent.data).where(
        JobEvent.id.in_(newest.group_by(JobEvent.job_id))))
    return {job_id: {k: data.get(k) for k in ("step", *LATEST_KEYS) if k in data} for job_id, data in rows}


@router.get("/jobs/{job_id}")
def get_job(job_id: str, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        return _job_json(_job(s, t, job_id))


@router.post("/jobs/{job_id}/cancel")
def cancel_job(job_id: str, request: Request, t: Tenant = TENANT) -> dict:
    """A queued job is cancelled at once; a starting or running one is asked to stop (the scheduler ends it).
    Through the state machine: if the scheduler moved the job meanwhile, cancel what it is now."""
    with db(request) as s:
        job = _job(s, t, job_id)
        for _ in range(10):  # each lost race moved the job on; it ends in a few moves at most
            state = JobState(job.state)
            if state.terminal or state is JobState.CANCELLING:
                if state is JobState.CANCELLING:
                    return _job_json(job)
                raise ServiceError(f"job {job.id} already ended ({state.value})", status=409)
            to = JobState.CANCELLED if state is JobState.QUEUED else JobState.CANCELLING
            extra = {"finished_at": now()} if to is JobState.CANCELLED else {}
            if move(s, job, to, event={"by": "tenant"}, **extra):
                s.commit()
                return _job_json(job)
            s.rollback()
        raise ServiceError(f"job {job.id} changed state too often to cancel; try again", status=409)


PAGE = 500
"""Events one read of a stream takes from the store."""
KEEPALIVE = ": keep-alive\n\n"
"""An SSE comment: clients ignore it; it shows the connection is alive, and fails on a dead one."""


def _sse(kind: str, data: dict, event_id: int | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {json.dumps(data)}\n\n"


def _events(request: Request, job_id: str, after: int) -> tuple[str, list[tuple[int, str]]]:
    """The job's state, then its next events as SSE text. The state first: a job ended before the
    events are read, so they include its last ones."""
    with db(request) as s:
        state = s.scalar(select(Job.state).where(Job.id == job_id))
        rows = s.execute(select(JobEvent.id, JobEvent.kind, JobEvent.data).where(
            JobEvent.job_id == job_id, JobEvent.id > after).order_by(JobEvent.id).limit(PAGE)).all()
    return state, [(i, _sse(kind, data, i)) for i, kind, data in rows]


class HeldStream(StreamingResponse):
    """A streaming response that gives its stream slot back when it ends, however it ends (done,
    the client gone, an error)."""

    def __init__(self, content, release, **kw):
        super().__init__(content, **kw)
        self._release = release

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def process_limits(request: Request) -> Limits:
    """The policy's top level: the API process's own settings (GLOBAL_ONLY)."""
    return (request.app.state.config.policy or Policy()).limits


@router.get("/jobs/{job_id}/events")
async def job_events(job_id: str, request: Request, after: int = Query(0, ge=0, le=MAX_ID), follow: bool = True,
                     t: Tenant = TENANT):
    """Server-sent events: each metrics record and state change, in order; with `follow`, the
    stream stays open until the job ends (an SSE comment every `event_keepalive_s` while quiet), or
    until no event came for `event_stream_idle_s`: then an `idle` event, and the client
    reconnects with ?after=<last id>. A tenant's streams beyond `max_event_streams` are a 429."""
    def check() -> str:
        with db(request) as s:
            return _job(s, t, job_id).id

    job_id = await run_in_threadpool(check)
    limits, top = limits_of(request, t), process_limits(request)
    release = request.app.state.event_slots.acquire(t.id, t.name, cap=limits.max_event_streams,
                                                    total_cap=top.max_event_streams_total)
    lines = _stream(request, job_id, after, follow, idle_s=limits.event_stream_idle_s,
                    keepalive_s=top.event_keepalive_s)
    return HeldStream(lines, release, media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream(request: Request, job_id: str, cursor: int, follow: bool, *, idle_s: float, keepalive_s: float):
    """The SSE text of a job's events after `cursor`. Reads the store only when the notifier
    says the job changed; each wait is registered before the read it follows, so no event
    committed after a read goes unnoticed."""
    notifier = request.app.state.notifier
    quiet_since, was_woken = time.monotonic(), False
    while True:
        woken, since = notifier.waiters.wait_for(job_id), notifier.since(job_id, was_woken)
        try:
            state, rows = await notifier.reads.read((job_id, cursor), since, partial(_events, request, job_id, cursor))
            for cursor, text in rows:
                yield text
            was_woken = False
            if len(rows) == PAGE:
                continue
            if rows:
                quiet_since = time.monotonic()
            if not follow or JobState(state).terminal:
                yield _sse("end", {"state": state})
                return
            while not woken.is_set():
                left = quiet_since + idle_s - time.monotonic()
                if left <= 0:
                    yield _sse("idle", {"after": cursor, "idle_seconds": idle_s, "state": state})
                    return
                try:
                    async with asyncio.timeout(min(keepalive_s, left)):  # (no task per wait, as wait_for makes)
                        await woken.wait()
                except TimeoutError:
                    if time.monotonic() < quiet_since + idle_s:
                        yield KEEPALIVE
            was_woken = True
        finally:
            notifier.waiters.forget(job_id, woken)


@router.get("/jobs/{job_id}/logs")
def job_logs(job_id: str, request: Request, attempt: int | None = Query(None, ge=1, le=1000),
             t: Tenant = TENANT) -> StreamingResponse:
    """An attempt's process output (stdout and stderr; the latest attempt by default), as the
    worker last uploaded it: while the attempt runs, every few seconds."""
    storage = request.app.state.storage
    with db(request) as s:
        job = _job(s, t, job_id)

    def key(n: int) -> str:
        return f"jobs/{job.tenant_id}/{job.id}/logs/attempt-{n}.log"

    # A preempted or interrupted attempt was given back (attempts - 1) and resumes under its own
    # number: its log is that of attempts + 1 until then.
    made = job.attempts + 1 if storage.exists(key(job.attempts + 1)) else job.attempts
    n = attempt or made
    if n < 1 or n > made or not storage.exists(key(n)):
        raise NotFound(f"job {job.id} has no log for attempt {n} (it has made {made} attempts)")
    return StreamingResponse(_read_chunks(storage, key(n)), media_type="text/plain; charset=utf-8")


def _read_chunks(storage, key: str):
    with storage.open(key) as f:
        while chunk := f.read(CHUNK):
            yield chunk


@router.get("/jobs/{job_id}/artifacts/{name}")
def artifact(job_id: str, name: str, request: Request, t: Tenant = TENANT) -> StreamingResponse:
    storage = request.app.state.storage
    with db(request) as s:
        job = _job(s, t, job_id)
    prefix = f"jobs/{job.tenant_id}/{job.id}"
    if name in ARTIFACTS:
        if not storage.exists(f"{prefix}/{name}"):
            raise NotFound(f"job {job.id} has no {name} yet (state {job.state})")
        return StreamingResponse(_read_chunks(storage, f"{prefix}/{name}"), media_type=ARTIFACTS[name])
    if name == "final_model.tar":
        key = final_model_key(job.tenant_id, job.id)
        if not storage.has_dir(key):
            raise NotFound(f"job {job.id} has no final model yet (state {job.state})")
        return StreamingResponse(tar_stream(storage, key), media_type="application/x-tar",
                                 headers={"Content-Disposition": f'attachment; filename="{job.id}-final_model.tar"'})
    raise NotFound(f"unknown artifact {name[:100]!r}; artifacts: {[*ARTIFACTS, 'final_model.tar']}")


def tar_stream(storage, key: str):
    """A tar of a stored directory, member by member in CHUNK-sized pieces. By hand around
    tarfile's own header encoding: TarFile.addfile copies a whole member into its output before
    returning, which would hold a multi-GB weights file in memory."""
    root = storage.path(key)
    for remote in sorted(storage.fs.find(root)):
        info = tarfile.TarInfo(f"final_model/{remote[len(root):].lstrip('/')}")
        info.size, info.mode = storage.fs.size(remote), 0o644
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        with storage.fs.open(remote, "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk
        if info.size % tarfile.BLOCKSIZE:
            yield tarfile.NUL * (tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE)
    yield tarfile.NUL * (2 * tarfile.BLOCKSIZE)  # end of archive
    # (tarfile also pads to a 10 KiB record; readers do not require it)


@router.get("/usage")
def usage(request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        rows = s.execute(select(Usage.kind, func.sum(Usage.amount)).where(Usage.tenant_id == t.id).group_by(Usage.kind))
        totals = {kind: float(amount) for kind, amount in rows}
        stored = s.scalar(select(func.coalesce(func.sum(Dataset.size_bytes), 0)).where(Dataset.tenant_id == t.id))
    return {"tenant": t.name, **{k.value: totals.get(k.value, 0.0) for k in UsageKind}, "dataset_bytes": int(stored),
            "event_streams": request.app.state.event_slots.by_tenant.get(t.id, 0)}


@router.get("/health")
def health(request: Request) -> dict:
    """Liveness, and what a client may wait for: registered base models and live workers (those
    whose lease is current: a dead worker's endpoint row stays behind until the janitor's sweep)."""
    import datetime as dt

    from lockstep.service.db import BaseModelEntry, Endpoint, now
    from lockstep.service.types import WORKER_LEASE_S

    with db(request) as s:
        models = s.scalar(select(func.count()).select_from(BaseModelEntry))
        live = list(s.execute(select(Endpoint.id, Endpoint.last_seen).where(
            Endpoint.role == "worker", Endpoint.last_seen >= now() - dt.timedelta(seconds=WORKER_LEASE_S))
            .order_by(Endpoint.id)))
    return {"status": "ok", "torch_loaded": "torch" in sys.modules, "base_models": models, "workers": len(live),
            "live_workers": [{"id": w.id, "last_seen": w.last_seen.isoformat() + "Z"} for w in live]}
