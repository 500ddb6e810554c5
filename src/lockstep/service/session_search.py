"""POST /api/v1/sessions/search (SDK 0.38's SessionSearchRequest): the caller's sessions, newest
first, paged by a (created_at, session_id) cursor.

Sessions are never shared between tenants, so every owner filter searches the caller's own
("user" matches only if it names the caller's tenant). lockstep sessions have no display name
(a display_name filter matches none) and are never failed or cancelled by the server (those
status filters match none); a finished session is "client_finished" with its reported reason.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import and_, func, or_, select

from lockstep.service import wire
from lockstep.service.bodies import SessionSearch
from lockstep.service.db import Checkpoint, Model, Session, Tenant, unexpired
from lockstep.service.types import ServiceError

REASONS = ("success", "errored", "interrupted")
SCAN_BATCH = 500


def _cursor_time(text: str) -> dt.datetime:
    try:
        at = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ServiceError(f"cursor.last_created_at {wire.shown(text)} is not an ISO 8601 time; pass a "
                           f"response's next_cursor back unchanged") from None
    return at.astimezone(dt.timezone.utc).replace(tzinfo=None) if at.tzinfo else at


def _status(row: Session) -> dict:
    if row.finished_at is None:
        return {"type": "active"}
    reason = row.finish_reason if row.finish_reason in REASONS else "success"
    return {"type": "client_finished", "reason": {"type": reason}}


def _status_matches(row: Session, body: SessionSearch) -> bool:
    if body.statuses is None:
        return True
    status = _status(row)
    return any(q.type == status["type"] and (q.type != "client_finished" or q.reasons is None
                                              or status["reason"]["type"] in q.reasons) for q in body.statuses)


def _matches(row: Session, body: SessionSearch) -> bool:
    meta = row.user_metadata or {}
    return all(meta.get(k) == v for k, v in body.user_metadata.items()) and _status_matches(row, body)


def _query(t: Tenant, body: SessionSearch):
    q = select(Session).where(Session.tenant_id == t.id)
    if body.session_id is not None or body.display_name is not None:
        q = q.where(Session.id == body.session_id)  # no display names here: only the id can match
    if body.project_ids is not None:
        q = q.where(Session.project_id.in_(body.project_ids))
    if body.cursor is not None:
        at = _cursor_time(body.cursor.last_created_at)
        after = and_(Session.created_at == at, Session.id < body.cursor.last_session_id)
        q = q.where(or_(Session.created_at < at, after))
    return q.order_by(Session.created_at.desc(), Session.id.desc())


def _summary(s, t: Tenant, row: Session) -> dict:
    runs = select(Model.id).where(Model.session_id == row.id, Model.tenant_id == t.id)
    count, size = s.execute(select(func.count(), func.coalesce(func.sum(Checkpoint.size_bytes), 0))
                            .where(Checkpoint.tenant_id == t.id, Checkpoint.model_id.in_(runs), unexpired())).one()
    meta = {k: v for k, v in (row.user_metadata or {}).items() if isinstance(v, str)}
    return {"session_id": row.id, "created_at": row.created_at.replace(tzinfo=dt.timezone.utc).isoformat(),
            "owner": t.name, "project_id": row.project_id or "", "status": _status(row), "checkpoints_count": count,
            "display_name": None, "user_metadata": meta or None, "checkpoint_storage_bytes": size}


def search(s, t: Tenant, body: SessionSearch) -> dict:
    if body.owner.type == "user" and t.name not in (body.owner.owner_urns or []):
        return {"sessions": [], "next_cursor": None}
    found: list[Session] = []
    # The metadata and status filters read JSON and two columns per row; scanning the caller's own
    # sessions in batches, newest first, stops as soon as a page (and one more) is found.
    rows = s.scalars(_query(t, body).execution_options(yield_per=SCAN_BATCH))
    for row in rows:
        if _matches(row, body):
            found.append(row)
            if len(found) > body.limit:
                break
    rows.close()
    page, more = found[:body.limit], len(found) > body.limit
    last = page[-1] if more else None
    cursor = {"last_created_at": last.created_at.replace(tzinfo=dt.timezone.utc).isoformat(),
              "last_session_id": last.id} if last else None
    return {"sessions": [_summary(s, t, r) for r in page], "next_cursor": cursor}
