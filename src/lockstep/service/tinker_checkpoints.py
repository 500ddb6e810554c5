"""What a tenant does with a checkpoint it has: publish it, set its TTL, copy it, and download an
external-weights export through expiring signed URLs.

- **Published** (POST/DELETE .../{cid}/publish, the owner only): any tenant may then *read* it by its
  tinker:// path: sample from it (create_sampling_session), load it into a training run of its
  own (load_weights, create_training_client_from_state), read its weights_info and copy_weights
  it. Nothing else: listing, deleting, re-publishing and its TTL stay the owner's, and another
  tenant never learns it exists except by being told its path. Reading includes downloading (load
  it into a run of one's own and export it, or copy an export and sign URLs for the copy), as on
  Tinker: publish only what may be handed out. Unpublishing
  stops new reads; a sampler or a copy made while it was public keeps its weights (they are
  pinned by storage key, and storage is deleted only when nothing points at it).
- **Copies** share the source's storage (no bytes are duplicated) and belong to a new training
  run of the caller's that holds checkpoints only (`Model.copied_from`: training it is refused).
  The run counts against the caller's model quota.
- **External weights URLs**: one per file of the caller's own `external_weights/<name>`
  checkpoint, expiring after signed_urls.URL_TTL_S.

Routes here are included before tinker_rest's `DELETE .../checkpoints/{checkpoint_id:path}`, which
would otherwise swallow `DELETE .../{cid}/publish`.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from sqlalchemy import select

from lockstep.service import signed_urls, wire
from lockstep.service.bodies import PRINTABLE, CopyWeights, SetTtl
from lockstep.service.db import Checkpoint, Model, Session, Tenant, now, unexpired
from lockstep.service.deps import db, tenant_of
from lockstep.service.tenants import check_model_quota, lock_quota
from lockstep.service.tinker_api import CHECKPOINT_KINDS, checkpoint_of, model_of, session_of
from lockstep.service.types import Conflict, NotFound, ServiceError

router = APIRouter()
TENANT = Depends(tenant_of)
RunId = Annotated[str, Path(max_length=160, pattern=PRINTABLE)]
CheckpointPath = Annotated[str, Path(max_length=200, pattern=PRINTABLE)]


def parse_checkpoint_id(checkpoint_id: str) -> tuple[str, str]:
    """'weights/<name>' (or sampler_weights/, external_weights/) -> (kind, name)."""
    kind, _, name = checkpoint_id.partition("/")
    if kind not in CHECKPOINT_KINDS:
        raise ServiceError(f"checkpoint_id {wire.shown(checkpoint_id)}: expected weights/<name>, "
                           f"sampler_weights/<name> or external_weights/<name>")
    return kind, wire.check_name(name, "checkpoint name")


def own_checkpoint(s, t: Tenant, run_id: str, checkpoint_id: str) -> Checkpoint:
    """The caller's own checkpoint (another tenant's, published or not, is a 404 like a missing one)."""
    kind, name = parse_checkpoint_id(checkpoint_id)
    model_of(s, t, run_id)
    ck = s.scalar(select(Checkpoint).where(Checkpoint.model_id == run_id, Checkpoint.kind == kind,
                                           Checkpoint.name == name, Checkpoint.tenant_id == t.id, unexpired()))
    if ck is None:
        raise NotFound(f"no checkpoint {wire.shown(checkpoint_id)} in {wire.shown(run_id)}")
    return ck


def _set_public(request: Request, t: Tenant, run_id: str, checkpoint_id: str, public: bool) -> dict:
    with db(request) as s:
        ck = own_checkpoint(s, t, run_id, checkpoint_id)
        if ck.public == public:
            raise Conflict(f"checkpoint {checkpoint_id} is already {'public' if public else 'private'}")
        ck.public = public
        s.commit()
    return {}


@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
def publish(run_id: RunId, checkpoint_id: CheckpointPath, request: Request, t: Tenant = TENANT) -> dict:
    return _set_public(request, t, run_id, checkpoint_id, True)


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
def unpublish(run_id: RunId, checkpoint_id: CheckpointPath, request: Request, t: Tenant = TENANT) -> dict:
    return _set_public(request, t, run_id, checkpoint_id, False)


def _expires(ttl_seconds: int | None) -> dt.datetime | None:
    return now() + dt.timedelta(seconds=ttl_seconds) if ttl_seconds is not None else None


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
def set_ttl(run_id: RunId, checkpoint_id: CheckpointPath, body: SetTtl, request: Request, t: Tenant = TENANT) -> dict:
    """From now; the janitor deletes the checkpoint within a pass of its expiry (None: never)."""
    with db(request) as s:
        ck = own_checkpoint(s, t, run_id, checkpoint_id)
        ck.expires_at = _expires(body.ttl_seconds)
        s.commit()
    return {}


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
def external_weights_urls(run_id: RunId, checkpoint_id: CheckpointPath, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        ck = own_checkpoint(s, t, run_id, checkpoint_id)
        key = ck.storage_path
    if ck.kind != "external_weights":
        raise ServiceError(f"{checkpoint_id} is not an external weights checkpoint: export it with "
                           f"save_weights_external first (download URLs are only signed for those)")
    expires = signed_urls.expiry()
    files = request.app.state.storage.files(key)
    return {"urls": {f: signed_urls.storage_url(request, f"{key}/{f}", expires) for f in files},
            "expires": signed_urls.iso(expires)}


def _copy_slot(s, t: Tenant, body: CopyWeights) -> tuple[str, str]:
    """(session id, run id) the copy goes to: the named slot of the caller's session, or slot 0 of
    a new session in the destination project (the copy's run needs a session to belong to)."""
    if body.session_id is not None:
        session_of(s, t, body.session_id)
        return body.session_id, f"{body.session_id}:train:{body.model_seq_id}"
    sid = uuid.uuid4().hex[:16]
    s.add(Session(id=sid, tenant_id=t.id, tags=["copy_weights"], project_id=body.destination_project_id,
                  finished_at=now(), finish_reason="success"))
    return sid, f"{sid}:train:0"


@router.post("/copy_weights")
def copy_weights(body: CopyWeights, request: Request, t: Tenant = TENANT) -> dict:
    if body.weights_access_token is not None:
        raise ServiceError("weights_access_token is not supported here: copy your own checkpoints, or ones their "
                           "owner published (publish_checkpoint_from_tinker_path)")
    with db(request) as s:
        src = checkpoint_of(s, t, body.source_path, readable=True)
        shape = s.get(Model, src.model_id)
        session_id, run_id = _copy_slot(s, t, body)
        path = f"tinker://{run_id}/{src.kind}/{src.name}"
        quota = lock_quota(s, t.id)  # held to the commit, as a model's creation holds it
        existing = s.get(Model, run_id)
        if existing is not None:
            if existing.copied_from == body.source_path:
                return {"tinker_path": path}  # a retried copy
            raise Conflict(f"training run {run_id} exists already; copy into another model_seq_id")
        check_model_quota(s, t, quota)
        s.add(Model(id=run_id, tenant_id=t.id, session_id=session_id, base_model=shape.base_model,
                    lora_rank=shape.lora_rank, lora_seed=shape.lora_seed, lora_config=shape.lora_config,
                    vocab_size=shape.vocab_size, copied_from=body.source_path))
        s.add(Checkpoint(tenant_id=t.id, model_id=run_id, kind=src.kind, name=src.name, storage_path=src.storage_path,
                         size_bytes=src.size_bytes, user_metadata=src.user_metadata or {},
                         expires_at=_expires(body.ttl_seconds)))
        s.commit()
    return {"tinker_path": path}
