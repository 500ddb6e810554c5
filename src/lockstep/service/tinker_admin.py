"""The SDK's admin and CLI routes, answered for the caller's own tenant only.

- GET  /billing/usage/events: the tenant's metered tokens in hourly buckets (the Usage rows the
  workers write: tokens trained, tokens sampled as packed, i.e. num_samples x (prompt + max_tokens)).
- GET  /billing/usage/checkpoints/current: its live checkpoints' count and bytes, by project.
- GET  /auth/apikey/me: the calling key's public metadata; DELETE revokes that key (a tenant has
  one key: the operator issues a new one with `lockstep tenants rotate-key`).
- GET  /audit: refused with a 403 that says where the records are (the server keeps no per-tenant
  audit log; the operator's API access log is the record).
No cost estimates: this server has no prices (every cost field is None).
"""

from __future__ import annotations

import datetime as dt
import uuid

from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy import func, select

from lockstep.service.bodies import ProjectId
from lockstep.service.db import Checkpoint, Model, Session, Tenant, Usage, unexpired
from lockstep.service.deps import db, tenant_of
from lockstep.service.types import ServiceError, UsageKind

router = APIRouter()
TENANT = Depends(tenant_of)
MAX_WINDOW = dt.timedelta(days=14)
EVENT_TYPES = {UsageKind.TOKENS_TRAINED.value: "training", UsageKind.TOKENS_SAMPLED.value: "sampling_sample"}


class Forbidden(ServiceError):
    status = 403


@router.get("/audit")
def audit(_t: Tenant = TENANT) -> dict:
    raise Forbidden("this server keeps no per-tenant audit log: ask its operator for the API's access log "
                    "(every request is logged with its tenant); your own requests are at GET /v1/trace")


def _utc(at: dt.datetime) -> dt.datetime:
    return at.astimezone(dt.timezone.utc).replace(tzinfo=None) if at.tzinfo else at


def _check_window(start: dt.datetime, end: dt.datetime) -> None:
    for name, at in (("starting_on", start), ("ending_before", end)):
        if at.minute or at.second or at.microsecond:
            raise ServiceError(f"{name} must be on a UTC hour boundary (minutes, seconds 0), got {at.isoformat()}")
    if start > dt.datetime.now(dt.timezone.utc).replace(tzinfo=None):
        raise ServiceError("starting_on must not be in the future")
    if not start < end <= start + MAX_WINDOW:
        raise ServiceError("ending_before must be after starting_on and at most 14 days after it")


def _hour(s, column):
    """The UTC hour a timestamp falls in, as the store computes it (grouped there, not in Python)."""
    if s.get_bind().dialect.name == "postgresql":
        return func.to_char(func.date_trunc("hour", column), "YYYY-MM-DD HH24")
    return func.strftime("%Y-%m-%d %H", column)


@router.get("/billing/usage/events")
def usage_events(request: Request, starting_on: dt.datetime = Query(), ending_before: dt.datetime = Query(),
                 t: Tenant = TENANT) -> dict:
    start, end = _utc(starting_on), _utc(ending_before)
    _check_window(start, end)
    with db(request) as s:
        hour = _hour(s, Usage.created_at)
        rows = s.execute(select(hour, Usage.kind, func.sum(Usage.amount))
                         .where(Usage.tenant_id == t.id, Usage.kind.in_(EVENT_TYPES), Usage.created_at >= start,
                                Usage.created_at < end)
                         .group_by(hour, Usage.kind).order_by(hour)).all()
    data = []
    for bucket, kind, amount in rows:
        at = dt.datetime.strptime(bucket, "%Y-%m-%d %H").replace(tzinfo=dt.timezone.utc)
        data.append({"bucket_start": at.isoformat(), "bucket_end": (at + dt.timedelta(hours=1)).isoformat(),
                     "user_id": t.name, "user_name": t.name,
                     "event_info": {"type": EVENT_TYPES[kind], "token_count": int(amount)}})
    return {"data": data, "sessions": {}, "cost_data_through": None}


@router.get("/billing/usage/checkpoints/current")
def checkpoint_usage(request: Request, project_id: ProjectId | None = Query(None), t: Tenant = TENANT) -> dict:
    with db(request) as s:
        q = (select(Session.project_id, func.count(Checkpoint.id), func.coalesce(func.sum(Checkpoint.size_bytes), 0))
             .select_from(Checkpoint).join(Model, Model.id == Checkpoint.model_id)
             .join(Session, Session.id == Model.session_id, isouter=True)
             .where(Checkpoint.tenant_id == t.id, unexpired()).group_by(Session.project_id))
        if project_id is not None:
            q = q.where(Session.project_id == project_id)
        rows = s.execute(q).all()
    return {"data": [{"project_id": project, "org_user_urn": t.name, "user_name": t.name, "checkpoint_count": count,
                      "size_bytes": int(size), "size_gigabytes": int(size) / 1e9} for project, count, size in rows]}


def _key_id(t: Tenant) -> int:
    """A stable number for the tenant's key (32 bits of its stored hash; the holder has the key)."""
    return int(t.key_hash[:8], 16) if all(c in "0123456789abcdef" for c in t.key_hash[:8]) else 0


@router.get("/auth/apikey/me")
def key_info(t: Tenant = TENANT) -> dict:
    return {"key_id": _key_id(t), "name": t.name, "note": "the API key of lockstep tenant " + t.name,
            "details": {"org_details": {"name": t.name}, "user_details": {"email": ""}}}


@router.delete("/auth/apikey/me")
def revoke_key(request: Request, t: Tenant = TENANT) -> dict:
    """Revoke the calling key (and nothing else). Other API instances may accept it for up to
    deps.AUTH_TTL_S more seconds (their key cache); this one forgets it now."""
    with db(request) as s:
        row = s.get(Tenant, t.id)
        row.key_hash = f"revoked-{uuid.uuid4().hex}"  # no sha256 hex digest looks like this
        s.commit()
    cache: dict = request.app.state.auth_cache
    for key in [k for k, (tenant, _) in list(cache.items()) if tenant.id == t.id]:
        cache.pop(key, None)
    return {}
