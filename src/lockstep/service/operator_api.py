"""GET /v1/operator/overview: every tenant's share of the service, every job, the service's health
and its recent alerts, for the operator's bearer token only (LOCKSTEP_OPERATOR_TOKEN; off without
one, as GET /metrics). A tenant's API key is refused here, and the operator's token is no tenant
key: the tenant endpoints refuse it."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter, Query, Request
from sqlalchemy import func, select

from lockstep.service.db import Job, Model, Session, Tenant, Usage
from lockstep.service.db import Request as RequestRow
from lockstep.service.deps import db
from lockstep.service.service_metrics import service_record
from lockstep.service.types import NotFound, RequestState, Unauthorized

router = APIRouter()


def require_operator(request: Request) -> None:
    metrics = request.app.state.metrics
    if not metrics.operator_token:
        raise NotFound("the operator's endpoints are off: start the server with LOCKSTEP_OPERATOR_TOKEN set")
    if not metrics.allowed(request.headers.get("authorization")):
        raise Unauthorized("this endpoint needs the operator's token: Authorization: Bearer <token>")


def _grouped(s, query) -> dict:
    out: dict = {}
    for tenant, key, n in s.execute(query):
        out.setdefault(tenant, {})[key] = n
    return out


@router.get("/operator/overview")
def overview(request: Request, limit: int = Query(500, ge=1, le=5000)) -> dict:
    require_operator(request)
    from lockstep.service.jobs_api import latest_metrics

    with db(request) as s:
        names = dict(s.execute(select(Tenant.id, Tenant.name)).all())
        jobs = _grouped(s, select(Job.tenant_id, Job.state, func.count()).group_by(Job.tenant_id, Job.state))
        requests = _grouped(s, select(RequestRow.tenant_id, RequestRow.state, func.count())
                            .where(RequestRow.state.in_((RequestState.QUEUED.value, RequestState.RUNNING.value)))
                            .group_by(RequestRow.tenant_id, RequestRow.state))
        usage = _grouped(s, select(Usage.tenant_id, Usage.kind, func.sum(Usage.amount)).group_by(Usage.tenant_id, Usage.kind))
        sessions = dict(s.execute(select(Session.tenant_id, func.count()).where(Session.finished_at.is_(None))
                                  .group_by(Session.tenant_id)).all())
        models = dict(s.execute(select(Model.tenant_id, func.count()).group_by(Model.tenant_id)).all())
        tenants = [{"tenant": name, "jobs": jobs.get(tid, {}), "requests_in_flight": requests.get(tid, {}),
                    "sessions": sessions.get(tid, 0), "models": models.get(tid, 0),
                    "usage": {k: float(v or 0) for k, v in usage.get(tid, {}).items()}}
                   for tid, name in sorted(names.items(), key=lambda kv: kv[1])]
        recent = list(s.scalars(select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)))
        latest = latest_metrics(s, [j.id for j in recent])
        all_jobs = [{"id": j.id, "tenant": names.get(j.tenant_id), "name": j.name, "state": j.state,
                     "attempts": j.attempts, "max_attempts": j.max_attempts, "run_seconds": j.run_seconds,
                     "latest": latest.get(j.id)} for j in reversed(recent)]
    return {"tenants": tenants, "jobs": all_jobs, "health": service_record(request.app.state.sessions),
            "alerts": _recent_alerts(request.app.state.config.alerts_path)}


def _recent_alerts(path: str | None, n: int = 50) -> list[dict]:
    if not path or not Path(path).is_file():
        return []
    out = []
    for line in Path(path).read_text().splitlines()[-n:]:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
