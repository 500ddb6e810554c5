"""The Tinker API (SDK 0.38 wire protocol, see shared reference `tinker_protocol.md`), under /api/v1.

Sessions, models, training, sampling and futures; the REST listings are in tinker_rest.py. Every
body is typed and bounded (bodies.py, wire.py) and validated completely against its model, then
becomes a queued request (a future); `retrieve_future` long-polls the row. A training request
refused once its model and seq_id are known still settles that seq_id (queue.refuse), so the
model's later requests do not wait for it.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from sqlalchemy import bindparam, or_, select
from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool

from lockstep.service import queue, sample_extras, stability, wire
from lockstep.service.bodies import (MAX_SEQ, PRINTABLE, CreateModel, CreateSamplingSession, CreateSession, Finish,
                                     LoadWeights, LoraConfig, ModelRef, OptimStep, Retrieve, Sample, SaveWeights,
                                     SaveWeightsExternal, SessionRef, Training)
from lockstep.service.db import BaseModelEntry, Checkpoint, Model, SamplingSession, Session, Tenant, now, unexpired
from lockstep.service.deps import (ServiceConfig, config, db, result_response, ring_workers, tenant_of,
                                   validation_message, wait_for_result)
from lockstep.service.policy import Policy
from lockstep.service.sdk_versions import check_sdk_version
from lockstep.service.tenants import check_model_quota, lock_quota
from lockstep.service.types import Conflict, NotFound, RequestKind, ServiceError, check_loss

TENANT = Depends(tenant_of)
SessionPath = Annotated[str, Path(max_length=64, pattern=PRINTABLE)]
SamplerPath = Annotated[str, Path(max_length=160, pattern=PRINTABLE)]


class SettlingRoute(APIRoute):
    """A training route whose body fails validation but names the caller's model and a valid seq_id:
    the refusal is stored against that seq_id (queue.refuse) before the 400 goes out."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        kind = TRAINING_ROUTES[self.name]

        async def settle_on_error(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                await run_in_threadpool(_settle_invalid, request, kind, await request.body(), e)
                raise

        return settle_on_error


router = APIRouter()
training = APIRouter(route_class=SettlingRoute)
"""Routes that submit a model's seq_id-ordered requests (included into `router` at the end)."""
TRAINING_ROUTES = {"forward_backward": RequestKind.FORWARD_BACKWARD, "optim_step": RequestKind.OPTIM_STEP,
                   "save_weights": RequestKind.SAVE_WEIGHTS, "load_weights": RequestKind.LOAD_WEIGHTS,
                   "save_weights_for_sampler": RequestKind.SAVE_WEIGHTS_FOR_SAMPLER,
                   "save_weights_external": RequestKind.SAVE_WEIGHTS_EXTERNAL}


# -- bootstrap and sessions ----------------------------------------------------------------------
GATED_ROUTES = {
    "POST /api/v1/auth/token": ("client/config", "pjwt_auth_enabled", False),
    "POST /api/v1/create_custom_loss": ("client/config", "custom_loss_server_side", False),
    "POST /api/v1/retrieve_futures": ("client/config", "sample_use_retrieve_futures", False),
    "POST /api/v1/join_sampling_session": ("client/config", "sample_join_sampling_session", False),
    "POST /api/v1/cancel_future": ("client/dynamic_config", "sample_cancel_enabled", False),
}
"""SDK 0.38 routes this server does not answer, each with the flag of the config route that tells
the SDK never to call it (and the value that does): plain API-key auth (no JWT exchange), custom
losses computed client-side, one retrieve_future per sample, no joining sessions, no cancelling.
The one list of them: tests/test_tinker_routes.py walks every other SDK route and checks each of
these flags. Enabling a flag means answering its route and taking it off this list."""


@router.post("/client/config")
def client_config(request: Request, _t: Tenant = TENANT) -> dict:
    # Plain httpx transport, static key auth, every flag-gated extra off. Every token of a fwd/bwd
    # datum costs the SDK's chunk estimate at least 8 bytes (int32 token + target), so chunks of
    # 8 x max_tokens_per_request bytes never exceed the server's token cap.
    cfg = config(request)
    return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
            "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
            "sample_join_sampling_session": False, "fwdbwd_max_chunk_len": wire.MAX_DATA,
            "fwdbwd_max_chunk_bytes_count": 8 * cfg.max_tokens_per_request}


@router.post("/client/dynamic_config")
def dynamic_config(_t: Tenant = TENANT) -> dict:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}


@router.post("/create_session")
def create_session(body: CreateSession, request: Request, t: Tenant = TENANT) -> dict:
    warning = check_sdk_version(body.sdk_version)  # an SDK too old for this wire protocol: 400, nothing stored
    sid = uuid.uuid4().hex[:16]
    with db(request) as s:
        s.add(Session(id=sid, tenant_id=t.id, tags=list(body.tags), user_metadata=body.user_metadata or {},
                      sdk_version=body.sdk_version[:32]))
        s.commit()
    return {"session_id": sid, "type": "create_session", "warning_message": warning}


def session_of(s, t: Tenant, session_id: str) -> Session:
    row = s.get(Session, session_id)
    if row is None or row.tenant_id != t.id:
        raise NotFound(f"unknown session {wire.shown(session_id)}")
    return row


@router.post("/session_heartbeat")
def heartbeat(body: SessionRef, request: Request, t: Tenant = TENANT):
    with db(request) as s:
        row = session_of(s, t, body.session_id)
        if row.finished_at is not None:
            return JSONResponse({"error": "session finished", "category": "user"}, status_code=410)
        row.last_heartbeat = now()
        s.commit()
    return {"type": "session_heartbeat"}


@router.post("/telemetry")
def telemetry(_t: Tenant = TENANT) -> dict:
    return {"status": "accepted"}


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: SessionPath, body: Finish, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        row = session_of(s, t, session_id)
        reason = str(body.reason.get("type", "success"))
        row.finished_at, row.finish_reason = now(), "".join(c for c in reason if c.isprintable())[:32]
        s.commit()
    return {}


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
def capabilities(request: Request, _t: Tenant = TENANT) -> dict:
    with db(request) as s:
        models = list(s.scalars(select(BaseModelEntry)))
    return {"supported_models": [{"model_name": m.name, "max_context_length": m.max_context_length,
                                  "trainable": True, "sampleable": True} for m in models]}


# -- models --------------------------------------------------------------------------------------
def base_of(s, name: str) -> BaseModelEntry:
    entry = s.get(BaseModelEntry, name)
    if entry is None:
        known = [m.name for m in s.scalars(select(BaseModelEntry))]
        if not known:
            raise ServiceError(f"unknown base_model {wire.shown(name)}: no worker has registered models yet (is "
                               f"`lockstep worker` running? `lockstep serve` starts one and it takes a few seconds)",
                               status=503)
        raise ServiceError(f"unknown base_model {wire.shown(name)}; this server has {known}")
    return entry


_MT, _BT = Model.__table__, BaseModelEntry.__table__
_MODEL_BRIEF = (select(_MT.c.id, _MT.c.tenant_id, _MT.c.session_id, _MT.c.vocab_size, _BT.c.max_context_length,
                      _MT.c.copied_from)
                .outerjoin(_BT, _BT.c.name == _MT.c.base_model).where(_MT.c.id == bindparam("mid")))
"""What a training submission checks; Core and built once (see queue.py)."""


def model_of(s, t: Tenant, model_id: str) -> Model:
    row = s.get(Model, model_id)
    if row is None or row.tenant_id != t.id:
        raise NotFound(f"unknown model_id {wire.shown(model_id)}")
    return row


def _model_brief(s, t: Tenant, model_id: str):
    # The protobuf's model_id is not a bodies.py type: one that no id of ours can be is never looked
    # up (PostgreSQL refuses NUL in a query parameter).
    possible = len(model_id) <= 160 and model_id.isprintable()
    row = s.execute(_MODEL_BRIEF, {"mid": model_id}).first() if possible else None
    if row is None or row.tenant_id != t.id:
        raise NotFound(f"unknown model_id {wire.shown(model_id)}")
    if row.copied_from is not None:
        raise ServiceError(f"model_id {model_id} is a copy of {row.copied_from} (copy_weights): it holds checkpoints "
                           f"only and cannot be trained; load one into a new training run instead")
    return row


def _new_model(s, t: Tenant, session_id: str, model_seq_id: int, base: BaseModelEntry, lora: LoraConfig | None,
               user_metadata) -> Model:
    session_of(s, t, session_id)
    rank = lora.rank if lora is not None else 0
    if rank and not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise ServiceError("lora_config trains nothing: set at least one of train_attn, train_mlp, train_unembed")
    mid = f"{session_id}:train:{model_seq_id}"
    quota = lock_quota(s, t.id)  # held until the caller commits: concurrent creations queue up here
    existing = s.get(Model, mid)
    if existing is not None:
        return existing  # a retried creation: the queued request says the rest
    check_model_quota(s, t, quota)
    model = Model(id=mid, tenant_id=t.id, session_id=session_id, base_model=base.name, lora_rank=rank,
                  lora_seed=(lora.seed or 0) if lora else 0, lora_config=lora.model_dump() if rank else None,
                  vocab_size=base.vocab_size, user_metadata=user_metadata or {})
    s.add(model)
    s.flush()
    return model


@router.post("/create_model")
def create_model(body: CreateModel, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        base = base_of(s, body.base_model)
        model = _new_model(s, t, body.session_id, body.model_seq_id, base, body.lora_config, body.user_metadata)
        lora = body.lora_config.model_dump() if body.lora_config else None
        payload = json.dumps({"base_model": base.name, "lora_config": lora}).encode()
        req = queue.submit(s, tenant_id=t.id, kind=RequestKind.CREATE_MODEL, payload=payload, model_id=model.id,
                           seq_id=0)
    ring_workers(request)
    return {"request_id": req.id, "model_id": model.id}


@router.post("/get_info")
def get_info(body: ModelRef, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        m = model_of(s, t, body.model_id)
        base = base_of(s, m.base_model)
    return {"type": "get_info", "model_id": m.id,
            "model_data": {"arch": base.arch, "model_name": m.base_model, "tokenizer_id": base.path},
            "is_lora": m.lora_rank > 0, "lora_rank": m.lora_rank or None, "model_name": m.base_model}


# -- training ------------------------------------------------------------------------------------
def _queue_training(s, t: Tenant, model, seq_id: int, kind: RequestKind, prepare, fmt: str, raw: bytes,
                    num_tokens: int | None = None):
    """Validate (prepare(s, model) -> the payload to store) and queue; a refusal is stored against
    the seq_id (queue.refuse) unless a request holds it already, then re-raised. `num_tokens`: its
    size in a packed batch (forward and forward_backward only)."""
    held = queue.holder(s, model.id, seq_id)
    try:
        payload = prepare(s, model)
    except ServiceError as e:
        if held is None:
            queue.refuse(s, tenant_id=t.id, kind=kind, payload_sha=queue.digest(raw), model_id=model.id,
                         seq_id=seq_id, error=str(e))
        raise
    return queue.submit(s, tenant_id=t.id, kind=kind, payload=payload, payload_format=fmt, model_id=model.id,
                        seq_id=seq_id, held=held, num_tokens=num_tokens)


async def _submit_training(request: Request, t: Tenant, model_id: str, seq_id: int, kind: RequestKind, prepare,
                           fmt: str = "json", num_tokens: int | None = None) -> dict:
    raw = await request.body()

    def go():
        with db(request) as s:
            model = _model_brief(s, t, model_id)
            try:
                return _queue_training(s, t, model, seq_id, kind, prepare, fmt, raw, num_tokens)
            finally:
                ring_workers(request)  # a refusal may have let the model's next request run

    req = await run_in_threadpool(go)  # one thread hop for the whole submission: each costs ~0.2 ms here
    return {"request_id": req.id, "model_id": model_id}


def _settle_invalid(request: Request, kind: RequestKind, raw: bytes, e: RequestValidationError) -> None:
    """A training body pydantic refused: settle its seq_id if it names the caller's model and a
    valid seq_id (anything less cannot be placed in a model's order, and stays a bare 400)."""
    if not isinstance(e.body, dict):
        return
    try:
        ref = Training.model_validate({"model_id": e.body.get("model_id"), "seq_id": e.body.get("seq_id")})
    except ValidationError:
        return
    t = tenant_of(request)
    with db(request) as s:
        model = s.execute(_MODEL_BRIEF, {"mid": ref.model_id}).first()
        if model is None or model.tenant_id != t.id or queue.holder(s, model.id, ref.seq_id) is not None:
            return
        queue.refuse(s, tenant_id=t.id, kind=kind, payload_sha=queue.digest(raw), model_id=model.id,
                     seq_id=ref.seq_id, error=validation_message(e))
    ring_workers(request)


@training.post("/forward_backward")
async def forward_backward(request: Request, t: Tenant = TENANT):
    if "protobuf" not in request.headers.get("content-type", ""):
        raise ServiceError("forward_backward takes a protobuf ForwardBackwardRequest (Content-Type: "
                           "application/x-protobuf), as tinker SDK >= 0.25 sends")
    body = await request.body()
    msg = wire.parse_forward_backward(body)
    if not 1 <= msg.seq_id <= MAX_SEQ:
        raise ServiceError(f"seq_id must be >= 1 for training requests, got {msg.seq_id}")
    cfg: ServiceConfig = config(request)

    def prepare(s, model) -> bytes:
        fb = wire.forward_backward_from_pb(msg, max_tokens=cfg.max_tokens_per_request)
        stability.refuse_stable_reinforce(fb.loss_fn)
        check_loss(fb.loss_fn, fb.loss_fn_config)
        for i, d in enumerate(fb.data):
            wire.check_datum(i, d.model_input, d.loss_fn_inputs, model.vocab_size, model.max_context_length)
        wire.check_loss_inputs(fb)
        named = stability.check_provenance(s, tenant_id=t.id, session_id=model.session_id, msg=msg, fb=fb)
        stability.touch(s, named)  # checked in full first: a refused request restarts no record's day
        return body

    kind = RequestKind.FORWARD if msg.forward_only else RequestKind.FORWARD_BACKWARD
    return await _submit_training(request, t, msg.model_id, msg.seq_id, kind, prepare, "proto",
                                  wire.token_count(msg))


@training.post("/optim_step")
async def optim_step(body: OptimStep, request: Request, t: Tenant = TENANT) -> dict:
    payload = json.dumps({"adam_params": body.adam_params.model_dump()}).encode()
    return await _submit_training(request, t, body.model_id, body.seq_id, RequestKind.OPTIM_STEP,
                                  lambda _s, _model: payload)


@training.post("/save_weights")
async def save_weights(body: SaveWeights, request: Request, t: Tenant = TENANT) -> dict:
    def prepare(_s, _model) -> bytes:
        name = wire.check_name(body.path, "save_weights path")
        return json.dumps({"name": name, "ttl_seconds": body.ttl_seconds, "user_metadata": body.user_metadata,
                           "overwrite": body.overwrite}).encode()

    return await _submit_training(request, t, body.model_id, body.seq_id, RequestKind.SAVE_WEIGHTS, prepare)


@training.post("/save_weights_for_sampler")
async def save_weights_for_sampler(body: SaveWeights, request: Request, t: Tenant = TENANT) -> dict:
    def prepare(_s, _model) -> bytes:
        if body.path is None and body.sampling_session_seq_id is None:
            raise ServiceError("save_weights_for_sampler needs a path (a named save) or sampling_session_seq_id "
                               "(ephemeral)")
        if body.kind == "inflight" and body.path is not None:
            raise ServiceError("save_weights_for_sampler: kind 'inflight' publishes to the model's shared inflight "
                               "target and takes no path; send sampling_session_seq_id (or kind 'snapshot')")
        name = wire.check_name(body.path, "save_weights_for_sampler path") if body.path is not None else None
        return json.dumps({"name": name, "sampling_session_seq_id": body.sampling_session_seq_id,
                           "kind": body.kind or "snapshot", "ttl_seconds": body.ttl_seconds,
                           "user_metadata": body.user_metadata}).encode()

    return await _submit_training(request, t, body.model_id, body.seq_id, RequestKind.SAVE_WEIGHTS_FOR_SAMPLER,
                                  prepare)


CHECKPOINT_KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
"""A checkpoint's kind (its tinker:// path segment) -> the SDK's checkpoint_type."""


@training.post("/save_weights_external")
async def save_weights_external(body: SaveWeightsExternal, request: Request, t: Tenant = TENANT) -> dict:
    """The trainable weights as safetensors (a sampler snapshot's files), as external_weights/<name>:
    its files are downloaded through GET .../external_weights_urls."""
    if body.age_encryption_recipients:
        raise ServiceError("age_encryption_recipients is not supported by this server: send None; the files are "
                           "served only through expiring signed URLs of their owner's")

    def prepare(_s, _model) -> bytes:
        name = wire.check_name(body.path, "save_weights_external path")
        return json.dumps({"name": name, "ttl_seconds": body.ttl_seconds}).encode()

    return await _submit_training(request, t, body.model_id, body.seq_id, RequestKind.SAVE_WEIGHTS_EXTERNAL, prepare)


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """tinker://{run}/{weights|sampler_weights|external_weights}/{name} -> (run id, kind, name)."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise ServiceError(f"{wire.shown(path)} is not a tinker:// path (tinker://<run>/weights/<name>)")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in CHECKPOINT_KINDS or not all(parts) or len(parts[0]) > 160:
        raise ServiceError(f"{wire.shown(path)}: expected tinker://<run>/<kind>/<name>, <kind> one of "
                           f"{', '.join(CHECKPOINT_KINDS)}")
    return parts[0], parts[1], wire.check_name(parts[2], "checkpoint name")


def checkpoint_of(s, t: Tenant, path: str, *, readable: bool = False) -> Checkpoint:
    """The caller's checkpoint at `path`; `readable`: or another tenant's published one (reads only:
    sampling, loading, weights_info, copying; see tinker_checkpoints.py)."""
    run, kind, name = parse_tinker_path(path)
    whose = or_(Checkpoint.tenant_id == t.id, Checkpoint.public.is_(True)) if readable else Checkpoint.tenant_id == t.id
    ck = s.scalar(select(Checkpoint).where(Checkpoint.model_id == run, Checkpoint.kind == kind, Checkpoint.name == name,
                                           whose, unexpired()))
    if ck is None:
        raise NotFound(f"no checkpoint {wire.shown(path)}")
    return ck


def _load_payload(s, t: Tenant, body: LoadWeights) -> tuple[Checkpoint, bytes]:
    ck = checkpoint_of(s, t, body.path, readable=True)
    if ck.kind != "weights":
        raise ServiceError(f"{body.path}: load_weights needs a training checkpoint (.../weights/<name>)")
    return ck, json.dumps({"path": body.path, "storage_path": ck.storage_path, "optimizer": body.optimizer}).encode()


@training.post("/load_weights")
async def load_weights(body: LoadWeights, request: Request, t: Tenant = TENANT) -> dict:
    if body.model_id is not None:
        if body.seq_id is None:
            raise ServiceError("load_weights on an existing model needs seq_id >= 1")
        return await _submit_training(request, t, body.model_id, body.seq_id, RequestKind.LOAD_WEIGHTS,
                                      lambda s, _model: _load_payload(s, t, body)[1])
    if body.session_id is None or body.model_seq_id is None:
        raise ServiceError("load_weights needs model_id + seq_id, or session_id + model_seq_id")

    def create():  # create-via-load: the model takes its shape from the checkpoint
        with db(request) as s:
            ck, payload = _load_payload(s, t, body)
            src = s.get(Model, ck.model_id)
            lora = LoraConfig(**src.lora_config) if src.lora_config else None
            model = _new_model(s, t, body.session_id, body.model_seq_id, base_of(s, src.base_model), lora,
                               body.user_metadata)
            if model.done_seq >= 0 or model.base_model != src.base_model:
                raise Conflict(f"model {model.id} already exists; load_weights can only create it")
            req = queue.submit(s, tenant_id=t.id, kind=RequestKind.LOAD_WEIGHTS, payload=payload, model_id=model.id,
                               seq_id=0)
        ring_workers(request)
        return {"request_id": req.id, "model_id": model.id}

    return await run_in_threadpool(create)


# -- sampling ------------------------------------------------------------------------------------
@router.post("/create_sampling_session")
def create_sampling_session(body: CreateSamplingSession, request: Request, t: Tenant = TENANT) -> dict:
    ssid = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    with db(request) as s:
        session_of(s, t, body.session_id)
        if s.get(SamplingSession, ssid) is not None:
            return {"sampling_session_id": ssid, "type": "create_sampling_session"}
        if body.model_path:
            ck = checkpoint_of(s, t, body.model_path, readable=True)
            src = s.get(Model, ck.model_id)
            row = SamplingSession(id=ssid, tenant_id=t.id, session_id=body.session_id, base_model=src.base_model,
                                  model_path=body.model_path, weights_path=ck.storage_path, lora_rank=src.lora_rank,
                                  lora_config=src.lora_config, vocab_size=src.vocab_size)
        elif body.base_model:
            base = base_of(s, body.base_model)
            row = SamplingSession(id=ssid, tenant_id=t.id, session_id=body.session_id, base_model=base.name,
                                  vocab_size=base.vocab_size)
        else:
            raise ServiceError("create_sampling_session needs base_model or model_path")
        s.add(row)
        try:
            s.commit()
        except IntegrityError:  # a concurrent retry created it first: the same id, as a retry gets
            s.rollback()
    return {"sampling_session_id": ssid, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: SamplerPath, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        row = s.get(SamplingSession, sampler_id)
        if row is None or row.tenant_id != t.id:
            raise NotFound(f"unknown sampler {wire.shown(sampler_id)}")
    return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}


def check_sample(body: Sample, vocab_size: int, max_context: int, max_sampled_tokens: int) -> tuple[int, ...]:
    prompt = wire.tokens_from_model_input(body.prompt, "prompt", max_tokens=max_context)
    if not prompt:
        raise ServiceError("prompt is empty")
    wire.check_tokens(prompt, vocab_size, "prompt")
    p = body.sampling_params
    max_tokens = p.max_tokens if p.max_tokens is not None else 256
    if len(prompt) + max_tokens > max_context:
        raise ServiceError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) must fit the model's "
                           f"context of {max_context} tokens")
    if body.num_samples * max_tokens > max_sampled_tokens:
        raise ServiceError(f"num_samples x max_tokens ({body.num_samples} x {max_tokens}) exceeds this server's "
                           f"{max_sampled_tokens} sampled tokens per request; split it into several requests")
    stops = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    if any(isinstance(x, int) and not 0 <= x < vocab_size for x in stops) or any(x == "" for x in stops):
        raise ServiceError(f"sampling_params.stop: token ids must be in [0, {vocab_size}) and strings non-empty")
    sample_extras.check(body.model_dump(), len(prompt), vocab_size)  # top-k, target ids, alternatives, last_n
    return prompt


@router.post("/asample")
async def asample(body: Sample, request: Request, t: Tenant = TENANT) -> dict:
    cfg: ServiceConfig = config(request)

    def go():
        with db(request) as s:
            if not body.sampling_session_id:
                raise ServiceError("asample needs sampling_session_id (create one with create_sampling_session or "
                                   "save_weights_and_get_sampling_client)")
            ss = s.get(SamplingSession, body.sampling_session_id)
            if ss is None or ss.tenant_id != t.id:
                raise NotFound(f"unknown sampling_session_id {wire.shown(body.sampling_session_id)}")
            base = base_of(s, ss.base_model)
            prompt = check_sample(body, ss.vocab_size, base.max_context_length, cfg.max_sampled_tokens)
            max_tokens = body.sampling_params.max_tokens if body.sampling_params.max_tokens is not None else 256
            ids = stability.sequence_ids(ss.session_id, body.num_samples, recorded=bool(body.record_stability_info))
            if body.record_stability_info:
                quota = (cfg.policy or Policy()).for_tenant(t.name).stability_quota_tokens
                lock_quota(s, t.id)  # held to the commit: concurrent samples cannot overshoot the quota together
                stability.reserve(s, tenant=t, quota=quota, session_id=ss.session_id, sampling_session_id=ss.id,
                                  ids=ids, prompt=prompt, max_tokens=max_tokens)
            payload = json.dumps({**body.model_dump(), "sample_sequence_ids": ids}).encode()
            req = queue.submit(s, tenant_id=t.id, kind=RequestKind.SAMPLE, payload=payload, sampling_session_id=ss.id,
                               num_tokens=body.num_samples * (len(prompt) + max_tokens))
        ring_workers(request)
        return req, ids

    req, ids = await run_in_threadpool(go)
    return {"request_id": req.id, "sample_sequence_ids": ids}


# -- futures -------------------------------------------------------------------------------------
@router.post("/retrieve_future")
async def retrieve_future(body: Retrieve, request: Request, t: Tenant = TENANT) -> Response:
    row = await wait_for_result(request, t, body.request_id)
    return result_response(row)


router.include_router(training)
