"""Native jobs under /v1: submit a declarative RLTask (the `lockstep run` spec, as JSON), follow
it, cancel it, download its artifacts; and per-tenant usage. Auth: `Authorization: Bearer <key>`
or `X-API-Key`.
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
import tarfile
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy import func, select
from starlette.concurrency import run_in_threadpool

from lockstep.service.app import db, tenant_of
from lockstep.service.db import Job, JobEvent, Tenant, Usage
from lockstep.service.types import JobState, NotFound, Priority, QuotaExceeded, ServiceError, UsageKind, check_loss

router = APIRouter()
TENANT = Depends(tenant_of)
MAX_QUEUED = 100
"""Jobs a tenant may have waiting at once."""
ARTIFACTS = {"report.html": "text/html", "summary.json": "application/json", "metrics.jsonl": "application/x-ndjson",
             "config.json": "application/json"}


class Submit(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: dict[str, Any]
    """A RunSpec as JSON (what `lockstep run --dry-run` prints under "config", or a TOML's tables)."""
    name: str = ""
    priority: Priority = Priority.PREEMPTIBLE
    max_attempts: int = 3


def validate_spec(spec: dict) -> dict:
    """The full config validation of `lockstep run`, before anything is stored."""
    from lockstep.config import ConfigError, from_dict, to_dict

    try:
        run = from_dict(spec)
    except ConfigError as e:
        raise ServiceError(f"spec: {e}") from None
    except TypeError as e:
        raise ServiceError(f"spec: {e}") from None
    for i, stage in enumerate(run.stages):
        if stage.kind == "rl":
            try:
                check_loss(stage.loss, dict(stage.loss_config))
            except ServiceError as e:
                raise ServiceError(f"spec: stages[{i}].loss: {e}") from None
    if run.runtime.ray_address:
        raise ServiceError("spec: runtime.ray_address is set by the service; leave it empty")
    if run.model.path != "builtin" and not run.model.path.startswith("/"):
        raise ServiceError("spec: model.path must be 'builtin' or an absolute path registered on the workers")
    return to_dict(run)


def _job_json(job: Job) -> dict:
    return {"id": job.id, "name": job.name, "state": job.state, "priority": job.priority, "attempts": job.attempts,
            "max_attempts": job.max_attempts, "preemptions": job.preemptions, "error": job.error,
            "summary": job.summary, "created_at": job.created_at.isoformat(),
            "started_at": job.started_at.isoformat() if job.started_at else None,
            "finished_at": job.finished_at.isoformat() if job.finished_at else None, "spec": job.spec}


def _job(s, t: Tenant, job_id: str) -> Job:
    job = s.get(Job, job_id)
    if job is None or job.tenant_id != t.id:
        raise NotFound(f"unknown job {job_id!r}")
    return job


@router.post("/jobs")
def submit_job(body: Submit, request: Request, t: Tenant = TENANT) -> dict:
    spec = validate_spec(body.spec)
    if not 1 <= body.max_attempts <= 10:
        raise ServiceError("max_attempts must be in [1, 10]")
    with db(request) as s:
        waiting = s.scalar(select(func.count()).select_from(Job).where(Job.tenant_id == t.id,
                                                                       Job.state == JobState.QUEUED.value))
        if waiting >= MAX_QUEUED:
            raise QuotaExceeded(f"tenant {t.name!r} has {waiting} jobs waiting (at most {MAX_QUEUED})")
        job = Job(id=uuid.uuid4().hex[:16], tenant_id=t.id, name=body.name[:128], spec=spec,
                  priority=body.priority.value, max_attempts=body.max_attempts, state=JobState.QUEUED.value)
        s.add(job)
        s.add(JobEvent(job_id=job.id, kind="state", data={"state": job.state}))
        s.commit()
        return _job_json(job)


@router.get("/jobs")
def list_jobs(request: Request, t: Tenant = TENANT, state: str | None = None) -> dict:
    with db(request) as s:
        q = select(Job).where(Job.tenant_id == t.id)
        if state:
            q = q.where(Job.state == state)
        return {"jobs": [_job_json(j) for j in s.scalars(q.order_by(Job.created_at))]}


@router.get("/jobs/{job_id}")
def get_job(job_id: str, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        return _job_json(_job(s, t, job_id))


@router.post("/jobs/{job_id}/cancel")
def cancel_job(job_id: str, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        job = _job(s, t, job_id)
        state = JobState(job.state)
        if state.terminal:
            raise ServiceError(f"job {job_id} already ended ({state.value})", status=409)
        job.state = (JobState.CANCELLED if state is JobState.QUEUED else JobState.CANCELLING).value
        s.add(JobEvent(job_id=job.id, kind="state", data={"state": job.state}))
        s.commit()
        return _job_json(job)


def _events(request: Request, job_id: str, after: int) -> tuple[list[JobEvent], str]:
    with db(request) as s:
        rows = list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > after)
                              .order_by(JobEvent.id).limit(500)))
        return rows, s.get(Job, job_id).state


@router.get("/jobs/{job_id}/events")
async def job_events(job_id: str, request: Request, after: int = 0, follow: bool = True, t: Tenant = TENANT):
    """Server-sent events: each metrics record and state change, in order; with `follow`, the
    stream stays open until the job ends (resume with ?after=<last id>)."""
    def check():
        with db(request) as s:
            _job(s, t, job_id)

    await run_in_threadpool(check)

    async def stream():
        cursor = after
        while True:
            rows, state = await run_in_threadpool(_events, request, job_id, cursor)
            for row in rows:
                cursor = row.id
                yield f"id: {row.id}\nevent: {row.kind}\ndata: {json.dumps(row.data)}\n\n"
            if not rows and (not follow or JobState(state).terminal):
                yield f"event: end\ndata: {json.dumps({'state': state})}\n\n"
                return
            if not rows:
                if await request.is_disconnected():
                    return
                await asyncio.sleep(0.5)

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.get("/jobs/{job_id}/artifacts/{name}")
def artifact(job_id: str, name: str, request: Request, t: Tenant = TENANT) -> Response:
    storage = request.app.state.storage
    with db(request) as s:
        job = _job(s, t, job_id)
    prefix = f"jobs/{job.tenant_id}/{job.id}"
    if name in ARTIFACTS:
        if not storage.exists(f"{prefix}/{name}"):
            raise NotFound(f"job {job_id} has no {name} yet (state {job.state})")
        with storage.open(f"{prefix}/{name}") as f:
            return Response(f.read(), media_type=ARTIFACTS[name])
    if name == "final_model.tar":
        if not storage.has_dir(f"{prefix}/final_model"):
            raise NotFound(f"job {job_id} has no final model yet (state {job.state})")
        return Response(_tar(storage, f"{prefix}/final_model"), media_type="application/x-tar",
                        headers={"Content-Disposition": f'attachment; filename="{job_id}-final_model.tar"'})
    raise NotFound(f"unknown artifact {name!r}; artifacts: {[*ARTIFACTS, 'final_model.tar']}")


def _tar(storage, key: str) -> bytes:
    buf = io.BytesIO()
    root = storage.path(key)
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for remote in sorted(storage.fs.find(root)):
            rel = remote[len(root):].lstrip("/")
            with storage.fs.open(remote, "rb") as f:
                data = f.read()
            info = tarfile.TarInfo(f"final_model/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@router.get("/usage")
def usage(request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        rows = s.execute(select(Usage.kind, func.sum(Usage.amount)).where(Usage.tenant_id == t.id).group_by(Usage.kind))
        totals = {kind: float(amount) for kind, amount in rows}
    return {"tenant": t.name, **{k.value: totals.get(k.value, 0.0) for k in UsageKind}}


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
