"""The Tinker API's REST listings under /api/v1: training runs, checkpoints, sessions, weights info.

Every lookup filters on the caller's tenant (another tenant's object is a 404, like a missing one);
paging and path parameters are bounded (an id that cannot exist is a 400/404 before any query).
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request
from sqlalchemy import func, select

from lockstep.service import signed_urls
from lockstep.service.bodies import MAX_OFFSET, PRINTABLE, SessionSearch, SetProject, WeightsInfo
from lockstep.service.db import Checkpoint, Model, SamplingSession, Session, Tenant, unexpired
from lockstep.service.deps import db, tenant_of
from lockstep.service.janitor import delete_unreferenced
from lockstep.service.session_search import search
from lockstep.service.tinker_api import CHECKPOINT_KINDS, checkpoint_of, model_of, session_of
from lockstep.service.tinker_checkpoints import own_checkpoint

router = APIRouter()
TENANT = Depends(tenant_of)
Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET)]
RunId = Annotated[str, Path(max_length=160, pattern=PRINTABLE)]
SessionPath = Annotated[str, Path(max_length=64, pattern=PRINTABLE)]
CheckpointPath = Annotated[str, Path(max_length=200, pattern=PRINTABLE)]


def _iso(value: dt.datetime | None) -> str | None:
    return value.replace(tzinfo=dt.timezone.utc).isoformat() if value else None


def _checkpoint_json(c: Checkpoint) -> dict:
    return {"checkpoint_id": f"{c.kind}/{c.name}", "checkpoint_type": CHECKPOINT_KINDS[c.kind],
            "time": _iso(c.created_at), "tinker_path": f"tinker://{c.model_id}/{c.kind}/{c.name}",
            "size_bytes": c.size_bytes, "public": bool(c.public),
            "user_metadata": c.user_metadata or None, "expires_at": _iso(c.expires_at)}


def _run_json(s, m: Model, t: Tenant) -> dict:
    cks = list(s.scalars(select(Checkpoint).where(Checkpoint.model_id == m.id, unexpired())
                         .order_by(Checkpoint.created_at)))
    last = {k: next((c for c in reversed(cks) if c.kind == k), None) for k in ("weights", "sampler_weights")}
    return {"training_run_id": m.id, "base_model": m.base_model, "model_owner": t.name, "is_lora": m.lora_rank > 0,
            "corrupted": False, "lora_rank": m.lora_rank or None, "last_request_time": _iso(m.last_request_time),
            "last_checkpoint": _checkpoint_json(last["weights"]) if last["weights"] else None,
            "last_sampler_checkpoint": _checkpoint_json(last["sampler_weights"]) if last["sampler_weights"] else None,
            "user_metadata": m.user_metadata or None}


@router.get("/training_runs")
def training_runs(request: Request, limit: Limit = 20, offset: Offset = 0, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        q = select(Model).where(Model.tenant_id == t.id)
        total = s.scalar(select(func.count()).select_from(q.subquery()))
        runs = [_run_json(s, m, t) for m in s.scalars(q.order_by(Model.created_at).limit(limit).offset(offset))]
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/training_runs/{run_id}")
def training_run(run_id: RunId, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        return _run_json(s, model_of(s, t, run_id), t)


@router.get("/training_runs/{run_id}/checkpoints")
def run_checkpoints(run_id: RunId, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        model_of(s, t, run_id)
        cks = s.scalars(select(Checkpoint).where(Checkpoint.model_id == run_id, unexpired())
                        .order_by(Checkpoint.created_at))
        return {"checkpoints": [_checkpoint_json(c) for c in cks]}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(run_id: RunId, checkpoint_id: CheckpointPath, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        ck = own_checkpoint(s, t, run_id, checkpoint_id)
        key = ck.storage_path
        s.delete(ck)
        s.commit()
    # The row first, then the copy, and only if nothing else points at it (a sampling session
    # pinned to these weights): a crash in between leaks storage, never loses what is in use.
    delete_unreferenced(request.app.state.sessions, request.app.state.storage, key)
    return {}


@router.get("/checkpoints")
def all_checkpoints(request: Request, limit: Limit = 100, offset: Offset = 0, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        q = select(Checkpoint).where(Checkpoint.tenant_id == t.id, unexpired())
        total = s.scalar(select(func.count()).select_from(q.subquery()))
        cks = s.scalars(q.order_by(Checkpoint.created_at).limit(limit).offset(offset))
        return {"checkpoints": [_checkpoint_json(c) for c in cks],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/sessions")
def sessions(request: Request, limit: Limit = 20, offset: Offset = 0, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        rows = s.scalars(select(Session).where(Session.tenant_id == t.id).order_by(Session.created_at)
                         .limit(limit).offset(offset))
        return {"sessions": [r.id for r in rows]}


@router.get("/sessions/{session_id}")
def session_info(session_id: SessionPath, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        row = session_of(s, t, session_id)
        runs = [m.id for m in s.scalars(select(Model).where(Model.session_id == session_id, Model.tenant_id == t.id))]
        samplers = [x.id for x in s.scalars(select(SamplingSession).where(SamplingSession.session_id == session_id,
                                                                          SamplingSession.tenant_id == t.id))]
        return {"training_run_ids": runs, "sampler_ids": samplers, "user_metadata": row.user_metadata or None}


@router.post("/weights_info")
def weights_info(body: WeightsInfo, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        ck = checkpoint_of(s, t, body.tinker_path, readable=True)
        m = s.get(Model, ck.model_id)
    return {"base_model": m.base_model, "is_lora": m.lora_rank > 0, "lora_rank": m.lora_rank or None,
            "train_unembed": True, "train_mlp": True, "train_attn": True, "optimizer_config": {"type": "adamw"}}


@router.post("/sessions/search")
def sessions_search(body: SessionSearch, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        return search(s, t, body)


@router.put("/sessions/{session_id}/project")
def session_project(session_id: SessionPath, body: SetProject, request: Request, t: Tenant = TENANT) -> dict:
    """Projects are labels within the caller's tenant: any name may be used, none is shared."""
    with db(request) as s:
        session_of(s, t, session_id).project_id = body.project_id
        s.commit()
    return {}


@router.get("/sessions/{session_id}/trace_export")
def trace_export(session_id: SessionPath, request: Request, t: Tenant = TENANT) -> dict:
    """Ready at once: the URL renders the session's trace (Chrome/Perfetto JSON) when fetched."""
    with db(request) as s:
        session_of(s, t, session_id)
    return {"status": "ready", "url": signed_urls.sign(request, signed_urls.TRACE, session_id, signed_urls.expiry()),
            "error": None}
