"""The caller's view of its requests: GET /v1/trace (recent requests as Chrome/Perfetto
trace-event JSON) and GET /v1/stats (sessions, models, requests in flight, latency percentiles by
request kind, the workers).

In the trace each request is a span on the queue track (arrival -> claimed by a worker) and one on
the track of the worker that ran it (claimed -> finished; a running one ends now), named by its
kind. A tenant sees only its own requests; of the service it sees only how many workers are live
and busy.
"""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy import func, select

from lockstep.monitor.trace import chrome_trace
from lockstep.service.db import Model, SamplingSession, Session, Tenant, now
from lockstep.service.db import Request as RequestRow
from lockstep.service.deps import db, tenant_of
from lockstep.service.service_metrics import busy_workers, live_workers
from lockstep.service.types import RequestState

LATENCY_WINDOW = 1000
"""Finished requests of each kind that the percentiles are taken over (the newest)."""

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


def _percentiles(values: list[float]) -> dict:
    """p50, p90 and p99 by the nearest rank (no interpolation: each is a latency that happened)."""
    v = sorted(values)
    return {f"p{q}": v[min(len(v) - 1, max(0, -(-q * len(v) // 100) - 1))] for q in (50, 90, 99)}


@router.get("/stats")
def stats(request: Request, t: Tenant = Depends(tenant_of)) -> dict:
    """The caller's sessions, models, requests in flight, and latency by request kind (queue wait
    and total, seconds, over its newest finished requests of each kind)."""
    with db(request) as s:
        def count(table, *where) -> int:
            return s.scalar(select(func.count()).select_from(table).where(table.tenant_id == t.id, *where))

        in_flight = {f"{kind}/{state}": n for kind, state, n in s.execute(
            select(RequestRow.kind, RequestRow.state, func.count())
            .where(RequestRow.tenant_id == t.id, RequestRow.state.in_((RequestState.QUEUED.value, RequestState.RUNNING.value)))
            .group_by(RequestRow.kind, RequestRow.state))}
        latency = {}
        for (kind,) in s.execute(select(RequestRow.kind).where(RequestRow.tenant_id == t.id).distinct()):
            rows = s.execute(select(RequestRow.created_at, RequestRow.claimed_at, RequestRow.finished_at)
                             .where(RequestRow.tenant_id == t.id, RequestRow.kind == kind,
                                    RequestRow.finished_at.is_not(None), RequestRow.claimed_at.is_not(None))
                             .order_by(RequestRow.order.desc()).limit(LATENCY_WINDOW)).all()
            if rows:
                latency[kind] = {"count": len(rows),
                                 "total_s": _percentiles([(f - c).total_seconds() for c, _, f in rows]),
                                 "queue_wait_s": _percentiles([(q - c).total_seconds() for c, q, _ in rows])}
        return {"tenant": t.name, "sessions": count(Session, Session.finished_at.is_(None)), "models": count(Model),
                "sampling_sessions": count(SamplingSession), "requests_in_flight": in_flight,
                "queued": sum(n for k, n in in_flight.items() if k.endswith("/queued")), "latency": latency,
                "workers": {"live": live_workers(s), "busy": busy_workers(s)}}
