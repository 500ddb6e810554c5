"""GET /v1/trace: the caller's recent requests as Chrome/Perfetto trace-event JSON.

Each request is a span on the queue track (arrival -> claimed by a worker) and one on the track of
the worker that ran it (claimed -> finished; a running one ends now), named by its kind. A tenant
sees only its own requests.
"""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy import select

from lockstep.monitor.trace import chrome_trace
from lockstep.service.db import Request as RequestRow
from lockstep.service.db import Tenant, now
from lockstep.service.deps import db, tenant_of

router = APIRouter()


def _unix(t: dt.datetime) -> float:
    return t.replace(tzinfo=dt.timezone.utc).timestamp()


@router.get("/trace")
def trace(request: Request, limit: int = Query(1000, ge=1, le=10000), t: Tenant = Depends(tenant_of)) -> dict:
    """Spans of the caller's `limit` most recent requests."""
    with db(request) as s:
        rows = s.execute(select(RequestRow.id, RequestRow.kind, RequestRow.state, RequestRow.created_at,
                                RequestRow.claimed_at, RequestRow.finished_at, RequestRow.claimed_by)
                         .where(RequestRow.tenant_id == t.id).order_by(RequestRow.order.desc()).limit(limit)).all()
        at = _unix(now())
    spans = []
    for rid, kind, state, created, claimed, finished, worker in rows:
        args = {"request": rid, "kind": kind, "state": state}
        queued_until = claimed or finished
        spans.append({"name": f"queued {kind}", "track": "queue", "start": _unix(created),
                      "end": _unix(queued_until) if queued_until else at, "args": args})
        if claimed is not None:
            spans.append({"name": kind, "track": f"worker {worker or '?'}", "start": _unix(claimed),
                          "end": _unix(finished) if finished else at, "args": args})
    return chrome_trace(spans, f"lockstep service ({t.name})")
