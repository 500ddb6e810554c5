"""One session's requests as Chrome/Perfetto trace-event JSON (GET /sessions/{id}/trace_export).

Each request of the session's training runs and sampling sessions is a span on the queue track
(arrival -> claimed) and one on its run's or sampler's track (claimed -> finished). Rendered when
its signed URL is fetched, from the store as it stands then, so nothing is stored to clean up.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import or_, select

from lockstep.monitor.trace import chrome_trace
from lockstep.service.db import Model, SamplingSession, Session, now
from lockstep.service.db import Request as RequestRow

MAX_REQUESTS = 10_000
"""The newest requests a trace holds (a long session has more than a viewer wants)."""


def _unix(t: dt.datetime) -> float:
    return t.replace(tzinfo=dt.timezone.utc).timestamp()


def render(sessions, session_id: str) -> dict:
    with sessions() as s:
        row = s.get(Session, session_id)
        if row is None:
            return chrome_trace([], f"session {session_id} (deleted)")
        models = select(Model.id).where(Model.session_id == session_id, Model.tenant_id == row.tenant_id)
        samplers = select(SamplingSession.id).where(SamplingSession.session_id == session_id,
                                                    SamplingSession.tenant_id == row.tenant_id)
        rows = s.execute(select(RequestRow.id, RequestRow.kind, RequestRow.state, RequestRow.created_at,
                                RequestRow.claimed_at, RequestRow.finished_at, RequestRow.model_id,
                                RequestRow.sampling_session_id)
                         .where(RequestRow.tenant_id == row.tenant_id,
                                or_(RequestRow.model_id.in_(models), RequestRow.sampling_session_id.in_(samplers)))
                         .order_by(RequestRow.order.desc()).limit(MAX_REQUESTS)).all()
        at = _unix(now())
    spans = []
    for rid, kind, state, created, claimed, finished, model_id, sampler_id in reversed(rows):
        args = {"request": rid, "kind": kind, "state": state}
        queued_until = claimed or finished
        spans.append({"name": f"queued {kind}", "track": "queue", "start": _unix(created),
                      "end": _unix(queued_until) if queued_until else at, "args": args})
        if claimed is not None:
            spans.append({"name": kind, "track": sampler_id or model_id or "?", "start": _unix(claimed),
                          "end": _unix(finished) if finished else at, "args": args})
    return chrome_trace(spans, f"session {session_id}")
