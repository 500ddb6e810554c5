"""The Tinker API (SDK 0.38 wire protocol, see shared reference `tinker_protocol.md`), under /api/v1.

Sessions, models, training, sampling, futures and the REST listings. Submissions validate their
bodies completely, then become queued requests (a future); `retrieve_future` long-polls the row.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from sqlalchemy import bindparam, func, select

from lockstep.service import wire
from lockstep.service.app import db, result_response, ring_workers, tenant_of, wait_for_result
from lockstep.service.db import BaseModelEntry, Checkpoint, Model, SamplingSession, Session, Tenant, now
from lockstep.service.queue import submit
from lockstep.service.types import (Conflict, NotFound, QuotaExceeded, RequestKind, ServiceError, check_loss)

router = APIRouter()
TENANT = Depends(tenant_of)


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# -- bootstrap and sessions ----------------------------------------------------------------------
@router.post("/client/config")
def client_config(_t: Tenant = TENANT) -> dict:
    # Plain httpx transport, static key auth, every flag-gated extra off.
    return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
            "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
            "sample_join_sampling_session": False}


@router.post("/client/dynamic_config")
def dynamic_config(_t: Tenant = TENANT) -> dict:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}


class CreateSession(Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""


@router.post("/create_session")
def create_session(body: CreateSession, request: Request, t: Tenant = TENANT) -> dict:
    sid = uuid.uuid4().hex[:16]
    with db(request) as s:
        s.add(Session(id=sid, tenant_id=t.id, tags=list(body.tags), user_metadata=body.user_metadata or {},
                      sdk_version=body.sdk_version))
        s.commit()
    return {"session_id": sid, "type": "create_session"}


def _session(s, t: Tenant, session_id: str) -> Session:
    row = s.get(Session, session_id)
    if row is None or row.tenant_id != t.id:
        raise NotFound(f"unknown session {session_id!r}")
    return row


class SessionRef(Body):
    session_id: str


@router.post("/session_heartbeat")
def heartbeat(body: SessionRef, request: Request, t: Tenant = TENANT):
    with db(request) as s:
        row = _session(s, t, body.session_id)
        if row.finished_at is not None:
            return JSONResponse({"error": "session finished", "category": "user"}, status_code=410)
        row.last_heartbeat = now()
        s.commit()
    return {"type": "session_heartbeat"}


@router.post("/telemetry")
def telemetry(_t: Tenant = TENANT) -> dict:
    return {"status": "accepted"}


class Finish(Body):
    reason: dict[str, Any] = {}
    detail: str | None = None


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, body: Finish, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        row = _session(s, t, session_id)
        row.finished_at, row.finish_reason = now(), str(body.reason.get("type", "success"))[:32]
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
def _base(s, name: str) -> BaseModelEntry:
    entry = s.get(BaseModelEntry, name)
    if entry is None:
        known = [m.name for m in s.scalars(select(BaseModelEntry))]
        if not known:
            raise ServiceError(f"unknown base_model {name!r}: no worker has registered models yet (is `lockstep worker` "
                               f"running? `lockstep serve` starts one and it takes a few seconds)", status=503)
        raise ServiceError(f"unknown base_model {name!r}; this server has {known}")
    return entry


_MODEL_BRIEF = select(Model.__table__.c.id, Model.__table__.c.tenant_id, Model.__table__.c.vocab_size).where(
    Model.__table__.c.id == bindparam("mid"))
"""What a training submission checks; Core and built once (see queue.py)."""


def _model(s, t: Tenant, model_id: str) -> Model:
    row = s.get(Model, model_id)
    if row is None or row.tenant_id != t.id:
        raise NotFound(f"unknown model_id {model_id!r}")
    return row


class LoraConfig(Body):
    rank: int = 32
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModel(Body):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None


def _new_model(s, t: Tenant, session_id: str, model_seq_id: int, base: BaseModelEntry, lora: LoraConfig | None,
               user_metadata) -> Model:
    _session(s, t, session_id)
    if model_seq_id < 0:
        raise ServiceError(f"model_seq_id must be >= 0, got {model_seq_id}")
    mid = f"{session_id}:train:{model_seq_id}"
    existing = s.get(Model, mid)
    if existing is not None:
        return existing  # a retried creation: the queued request says the rest
    count = s.scalar(select(func.count()).select_from(Model).where(Model.tenant_id == t.id))
    quota = s.scalar(select(Tenant.max_models).where(Tenant.id == t.id))  # fresh: `t` may come from the auth cache
    if count >= quota:
        raise QuotaExceeded(f"tenant {t.name!r} already has {count} models (quota {quota})")
    rank = lora.rank if lora is not None else 0
    if rank < 0 or rank > 1024:
        raise ServiceError(f"lora_config.rank must be in [0, 1024] (0: full fine-tuning), got {rank}")
    model = Model(id=mid, tenant_id=t.id, session_id=session_id, base_model=base.name, lora_rank=rank,
                  lora_seed=(lora.seed or 0) if lora else 0, lora_config=lora.model_dump() if rank else None,
                  vocab_size=base.vocab_size, user_metadata=user_metadata or {})
    s.add(model)
    s.flush()
    return model


@router.post("/create_model")
def create_model(body: CreateModel, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        base = _base(s, body.base_model)
        model = _new_model(s, t, body.session_id, body.model_seq_id, base, body.lora_config, body.user_metadata)
        lora = body.lora_config.model_dump() if body.lora_config else None
        payload = json.dumps({"base_model": base.name, "lora_config": lora}).encode()
        req = submit(s, tenant_id=t.id, kind=RequestKind.CREATE_MODEL, payload=payload, model_id=model.id, seq_id=0)
    ring_workers(request)
    return {"request_id": req.id, "model_id": model.id}


class ModelRef(Body):
    model_id: str


@router.post("/get_info")
def get_info(body: ModelRef, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        m = _model(s, t, body.model_id)
        base = _base(s, m.base_model)
    return {"type": "get_info", "model_id": m.id,
            "model_data": {"arch": base.arch, "model_name": m.base_model, "tokenizer_id": base.path},
            "is_lora": m.lora_rank > 0, "lora_rank": m.lora_rank or None, "model_name": m.base_model}


# -- training ------------------------------------------------------------------------------------
@router.post("/forward_backward")
async def forward_backward(request: Request, t: Tenant = TENANT):
    body = await request.body()
    if "protobuf" not in request.headers.get("content-type", ""):
        raise ServiceError("forward_backward takes a protobuf ForwardBackwardRequest (Content-Type: "
                           "application/x-protobuf), as tinker SDK >= 0.25 sends")
    fb = wire.decode_forward_backward(body)
    check_loss(fb.loss_fn, fb.loss_fn_config)
    return await _submit_training(request, t, fb.model_id, fb.seq_id, body, "proto",
                                  RequestKind.FORWARD if fb.forward_only else RequestKind.FORWARD_BACKWARD,
                                  check=lambda m: [wire.check_datum(i, d.model_input, d.loss_fn_inputs, m.vocab_size)
                                                   for i, d in enumerate(fb.data)])


async def _submit_training(request: Request, t: Tenant, model_id: str, seq_id: int, payload: bytes, fmt: str,
                           kind: RequestKind, check=None) -> dict:
    from starlette.concurrency import run_in_threadpool

    def go():
        with db(request) as s:
            model = s.execute(_MODEL_BRIEF, {"mid": model_id}).first()
            if model is None or model.tenant_id != t.id:
                raise NotFound(f"unknown model_id {model_id!r}")
            if seq_id < 1:
                raise ServiceError(f"seq_id must be >= 1 for training requests, got {seq_id}")
            if check is not None:
                check(model)
            req = submit(s, tenant_id=t.id, kind=kind, payload=payload, payload_format=fmt, model_id=model.id,
                         seq_id=seq_id)
        ring_workers(request)
        return req

    req = await run_in_threadpool(go)  # one thread hop for the whole submission: each costs ~0.2 ms here
    return {"request_id": req.id, "model_id": model_id}


class AdamParams(Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(Body):
    model_id: str
    seq_id: int
    adam_params: AdamParams = AdamParams()


@router.post("/optim_step")
async def optim_step(body: OptimStep, request: Request, t: Tenant = TENANT) -> dict:
    a = body.adam_params
    for name in ("learning_rate", "eps", "weight_decay", "grad_clip_norm"):
        v = getattr(a, name)
        if not (v >= 0 and v < float("inf")):
            raise ServiceError(f"adam_params.{name} must be a finite number >= 0, got {v}")
    if not (0 <= a.beta1 < 1 and 0 <= a.beta2 < 1):
        raise ServiceError(f"adam_params.beta1 and beta2 must be in [0, 1), got {a.beta1}, {a.beta2}")
    payload = json.dumps({"adam_params": a.model_dump()}).encode()
    return await _submit_training(request, t, body.model_id, body.seq_id, payload, "json", RequestKind.OPTIM_STEP)


class SaveWeights(Body):
    model_id: str
    seq_id: int
    path: str | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, Any] | None = None
    sampling_session_seq_id: int | None = None
    kind: str | None = None
    overwrite: bool = False


@router.post("/save_weights")
async def save_weights(body: SaveWeights, request: Request, t: Tenant = TENANT) -> dict:
    name = wire.check_name(body.path, "save_weights path")
    payload = json.dumps({"name": name, "ttl_seconds": body.ttl_seconds, "user_metadata": body.user_metadata,
                          "overwrite": body.overwrite}).encode()
    return await _submit_training(request, t, body.model_id, body.seq_id, payload, "json", RequestKind.SAVE_WEIGHTS)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(body: SaveWeights, request: Request, t: Tenant = TENANT) -> dict:
    if body.path is None and body.sampling_session_seq_id is None:
        raise ServiceError("save_weights_for_sampler needs a path (a named save) or sampling_session_seq_id (ephemeral)")
    name = wire.check_name(body.path, "save_weights_for_sampler path") if body.path is not None else None
    payload = json.dumps({"name": name, "sampling_session_seq_id": body.sampling_session_seq_id,
                          "ttl_seconds": body.ttl_seconds, "user_metadata": body.user_metadata}).encode()
    return await _submit_training(request, t, body.model_id, body.seq_id, payload, "json",
                                  RequestKind.SAVE_WEIGHTS_FOR_SAMPLER)


class LoadWeights(Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    user_metadata: dict[str, Any] | None = None


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """tinker://{run}/{weights|sampler_weights}/{name} -> (run id, kind, name)."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise ServiceError(f"{path!r} is not a tinker:// path (tinker://<run>/weights/<name>)")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not all(parts):
        raise ServiceError(f"{path!r}: expected tinker://<run>/weights/<name> or tinker://<run>/sampler_weights/<name>")
    return parts[0], parts[1], parts[2]


def checkpoint_of(s, t: Tenant, path: str) -> Checkpoint:
    run, kind, name = parse_tinker_path(path)
    ck = s.scalar(select(Checkpoint).where(Checkpoint.model_id == run, Checkpoint.kind == kind, Checkpoint.name == name,
                                           Checkpoint.tenant_id == t.id))
    if ck is None:
        raise NotFound(f"no checkpoint {path}")
    return ck


@router.post("/load_weights")
async def load_weights(body: LoadWeights, request: Request, t: Tenant = TENANT) -> dict:
    from starlette.concurrency import run_in_threadpool

    def go():
        with db(request) as s:
            ck = checkpoint_of(s, t, body.path)
            if ck.kind != "weights":
                raise ServiceError(f"{body.path}: load_weights needs a training checkpoint (.../weights/<name>)")
            payload = json.dumps({"path": body.path, "storage_path": ck.storage_path, "optimizer": body.optimizer}).encode()
            if body.model_id is None:  # create-via-load: the model takes its shape from the checkpoint
                if body.session_id is None or body.model_seq_id is None:
                    raise ServiceError("load_weights needs model_id + seq_id, or session_id + model_seq_id")
                src = s.get(Model, ck.model_id)
                lora = LoraConfig(**src.lora_config) if src.lora_config else None
                model = _new_model(s, t, body.session_id, body.model_seq_id, _base(s, src.base_model), lora,
                                   body.user_metadata)
                if model.done_seq >= 0 or model.base_model != src.base_model:
                    raise Conflict(f"model {model.id} already exists; load_weights can only create it")
                return submit(s, tenant_id=t.id, kind=RequestKind.LOAD_WEIGHTS, payload=payload, model_id=model.id,
                              seq_id=0), model.id
            _model(s, t, body.model_id)
            if body.seq_id is None or body.seq_id < 1:
                raise ServiceError("load_weights on an existing model needs seq_id >= 1")
            return submit(s, tenant_id=t.id, kind=RequestKind.LOAD_WEIGHTS, payload=payload, model_id=body.model_id,
                          seq_id=body.seq_id), body.model_id

    req, model_id = await run_in_threadpool(go)
    await run_in_threadpool(ring_workers, request)
    return {"request_id": req.id, "model_id": model_id}


# -- sampling ------------------------------------------------------------------------------------
class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


@router.post("/create_sampling_session")
def create_sampling_session(body: CreateSamplingSession, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        _session(s, t, body.session_id)
        ssid = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        existing = s.get(SamplingSession, ssid)
        if existing is not None:
            return {"sampling_session_id": existing.id, "type": "create_sampling_session"}
        if body.model_path:
            ck = checkpoint_of(s, t, body.model_path)
            src = s.get(Model, ck.model_id)
            row = SamplingSession(id=ssid, tenant_id=t.id, session_id=body.session_id, base_model=src.base_model,
                                  model_path=body.model_path, weights_path=ck.storage_path, lora_rank=src.lora_rank,
                                  lora_config=src.lora_config, vocab_size=src.vocab_size)
        elif body.base_model:
            base = _base(s, body.base_model)
            row = SamplingSession(id=ssid, tenant_id=t.id, session_id=body.session_id, base_model=base.name,
                                  vocab_size=base.vocab_size)
        else:
            raise ServiceError("create_sampling_session needs base_model or model_path")
        s.add(row)
        s.commit()
    return {"sampling_session_id": ssid, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        row = s.get(SamplingSession, sampler_id)
        if row is None or row.tenant_id != t.id:
            raise NotFound(f"unknown sampler {sampler_id!r}")
    return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}


class SamplingParams(Body):
    max_tokens: int | None = None
    seed: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: str | list[str] | list[int] | None = None


class Sample(Body):
    sampling_session_id: str | None = None
    seq_id: int | None = None
    num_samples: int = 1
    prompt: dict[str, Any]
    sampling_params: SamplingParams = SamplingParams()
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: dict[str, Any] | None = None
    base_model: str | None = None
    model_path: str | None = None


MAX_SAMPLES = 256


def check_sample(body: Sample, vocab_size: int, max_context: int) -> tuple[int, ...]:
    for name, value in (("topk_prompt_logprobs", body.topk_prompt_logprobs),
                        ("topk_sample_logprobs", body.topk_sample_logprobs),
                        ("prompt_alt_tokens_k", body.prompt_alt_tokens_k)):
        if value:
            raise ServiceError(f"{name} is not supported by this server; send 0")
    if body.prompt_logprobs_last_n is not None or body.target_prompt_logprobs is not None:
        raise ServiceError("prompt_logprobs_last_n and target_prompt_logprobs are not supported by this server")
    if not 1 <= body.num_samples <= MAX_SAMPLES:
        raise ServiceError(f"num_samples must be in [1, {MAX_SAMPLES}], got {body.num_samples}")
    prompt = wire.tokens_from_model_input(body.prompt, "prompt")
    if not prompt:
        raise ServiceError("prompt is empty")
    wire.check_tokens(prompt, vocab_size, "prompt")
    p = body.sampling_params
    max_tokens = p.max_tokens if p.max_tokens is not None else 256
    if not 1 <= max_tokens or len(prompt) + max_tokens > max_context:
        raise ServiceError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) must fit the model's "
                           f"context of {max_context} tokens, with max_tokens >= 1")
    if not (0 <= p.temperature <= 100) or not (0 < p.top_p <= 1) or not (p.top_k == -1 or p.top_k >= 1):
        raise ServiceError("sampling_params: temperature in [0, 100], top_p in (0, 1], top_k -1 (off) or >= 1")
    stops = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    if any(isinstance(x, int) and not 0 <= x < vocab_size for x in stops) or any(x == "" for x in stops):
        raise ServiceError(f"sampling_params.stop: token ids must be in [0, {vocab_size}) and strings non-empty")
    return prompt


@router.post("/asample")
async def asample(body: Sample, request: Request, t: Tenant = TENANT) -> dict:
    from starlette.concurrency import run_in_threadpool

    def go():
        with db(request) as s:
            if not body.sampling_session_id:
                raise ServiceError("asample needs sampling_session_id (create one with create_sampling_session or "
                                   "save_weights_and_get_sampling_client)")
            ss = s.get(SamplingSession, body.sampling_session_id)
            if ss is None or ss.tenant_id != t.id:
                raise NotFound(f"unknown sampling_session_id {body.sampling_session_id!r}")
            base = _base(s, ss.base_model)
            check_sample(body, ss.vocab_size, base.max_context_length)
            ids = [uuid.uuid4().hex for _ in range(body.num_samples)]
            payload = json.dumps({**body.model_dump(), "sample_sequence_ids": ids}).encode()
            req = submit(s, tenant_id=t.id, kind=RequestKind.SAMPLE, payload=payload, sampling_session_id=ss.id)
        ring_workers(request)
        return req, ids

    req, ids = await run_in_threadpool(go)
    return {"request_id": req.id, "sample_sequence_ids": ids}


# -- futures -------------------------------------------------------------------------------------
class Retrieve(Body):
    request_id: str
    allow_metadata_only: bool = False


@router.post("/retrieve_future")
async def retrieve_future(body: Retrieve, request: Request, t: Tenant = TENANT) -> Response:
    row = await wait_for_result(request, t, body.request_id)
    return result_response(row)


# -- REST listings -------------------------------------------------------------------------------
def _iso(value: dt.datetime | None) -> str | None:
    return value.replace(tzinfo=dt.timezone.utc).isoformat() if value else None


def _checkpoint_json(c: Checkpoint) -> dict:
    kind = {"weights": "training", "sampler_weights": "sampler"}[c.kind]
    return {"checkpoint_id": f"{c.kind}/{c.name}", "checkpoint_type": kind, "time": _iso(c.created_at),
            "tinker_path": f"tinker://{c.model_id}/{c.kind}/{c.name}", "size_bytes": c.size_bytes, "public": False,
            "user_metadata": c.user_metadata or None, "expires_at": _iso(c.expires_at)}


def _run_json(s, m: Model, t: Tenant) -> dict:
    cks = list(s.scalars(select(Checkpoint).where(Checkpoint.model_id == m.id).order_by(Checkpoint.created_at)))
    last = {k: next((c for c in reversed(cks) if c.kind == k), None) for k in ("weights", "sampler_weights")}
    return {"training_run_id": m.id, "base_model": m.base_model, "model_owner": t.name, "is_lora": m.lora_rank > 0,
            "corrupted": False, "lora_rank": m.lora_rank or None, "last_request_time": _iso(m.last_request_time),
            "last_checkpoint": _checkpoint_json(last["weights"]) if last["weights"] else None,
            "last_sampler_checkpoint": _checkpoint_json(last["sampler_weights"]) if last["sampler_weights"] else None,
            "user_metadata": m.user_metadata or None}


def _page(limit: int, offset: int) -> tuple[int, int]:
    if not (1 <= limit <= 1000 and offset >= 0):
        raise ServiceError("limit must be in [1, 1000] and offset >= 0")
    return limit, offset


@router.get("/training_runs")
def training_runs(request: Request, limit: int = 20, offset: int = 0, t: Tenant = TENANT) -> dict:
    limit, offset = _page(limit, offset)
    with db(request) as s:
        q = select(Model).where(Model.tenant_id == t.id)
        total = s.scalar(select(func.count()).select_from(q.subquery()))
        runs = [_run_json(s, m, t) for m in s.scalars(q.order_by(Model.created_at).limit(limit).offset(offset))]
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/training_runs/{run_id}")
def training_run(run_id: str, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        return _run_json(s, _model(s, t, run_id), t)


@router.get("/training_runs/{run_id}/checkpoints")
def run_checkpoints(run_id: str, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        _model(s, t, run_id)
        cks = s.scalars(select(Checkpoint).where(Checkpoint.model_id == run_id).order_by(Checkpoint.created_at))
        return {"checkpoints": [_checkpoint_json(c) for c in cks]}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request, t: Tenant = TENANT) -> dict:
    kind, _, name = checkpoint_id.partition("/")
    with db(request) as s:
        _model(s, t, run_id)
        ck = s.scalar(select(Checkpoint).where(Checkpoint.model_id == run_id, Checkpoint.kind == kind,
                                               Checkpoint.name == name))
        if ck is None:
            raise NotFound(f"no checkpoint {checkpoint_id!r} in {run_id}")
        request.app.state.storage.delete(ck.storage_path)
        s.delete(ck)
        s.commit()
    return {}


@router.get("/checkpoints")
def all_checkpoints(request: Request, limit: int = 100, offset: int = 0, t: Tenant = TENANT) -> dict:
    limit, offset = _page(limit, offset)
    with db(request) as s:
        q = select(Checkpoint).where(Checkpoint.tenant_id == t.id)
        total = s.scalar(select(func.count()).select_from(q.subquery()))
        cks = s.scalars(q.order_by(Checkpoint.created_at).limit(limit).offset(offset))
        return {"checkpoints": [_checkpoint_json(c) for c in cks],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/sessions")
def sessions(request: Request, limit: int = 20, offset: int = 0, t: Tenant = TENANT) -> dict:
    limit, offset = _page(limit, offset)
    with db(request) as s:
        rows = s.scalars(select(Session).where(Session.tenant_id == t.id).order_by(Session.created_at)
                         .limit(limit).offset(offset))
        return {"sessions": [r.id for r in rows]}


@router.get("/sessions/{session_id}")
def session_info(session_id: str, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        row = _session(s, t, session_id)
        runs = [m.id for m in s.scalars(select(Model).where(Model.session_id == session_id))]
        samplers = [x.id for x in s.scalars(select(SamplingSession).where(SamplingSession.session_id == session_id))]
        return {"training_run_ids": runs, "sampler_ids": samplers, "user_metadata": row.user_metadata or None}


class WeightsInfo(Body):
    tinker_path: str


@router.post("/weights_info")
def weights_info(body: WeightsInfo, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        ck = checkpoint_of(s, t, body.tinker_path)
        m = s.get(Model, ck.model_id)
    return {"base_model": m.base_model, "is_lora": m.lora_rank > 0, "lora_rank": m.lora_rank or None,
            "train_unembed": True, "train_mlp": True, "train_attn": True, "optimizer_config": {"type": "adamw"}}

