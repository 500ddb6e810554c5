"""What the API's routers share: the config, a store session, the caller's tenant, the long-poll.

The routers import this module and app.py assembles them, so neither imports the other.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy import bindparam, select
from starlette.concurrency import run_in_threadpool

from lockstep.service import doorbell
from lockstep.service.db import Request as RequestRow
from lockstep.service.db import Tenant
from lockstep.service.tenants import authenticate
from lockstep.service.types import NotFound, RequestState, Unauthorized


@dataclass(frozen=True)
class ServiceConfig:
    db_url: str
    storage_url: str
    max_body_bytes: int = 32 * 1024 * 1024
    """Bodies above this are refused with 413 (the SDK chunks fwd/bwd requests at ~5 MB)."""
    poll_timeout_s: float = 25.0
    """retrieve_future holds a pending request this long (under the SDK's 45 s timeout)."""
    fallback_poll_s: float = 0.2
    """Store re-check interval while waiting, in case a doorbell datagram was lost."""
    max_tokens_per_request: int = 65536
    """Tokens (model inputs, summed over data) one forward/forward_backward request may carry. The
    SDK is told to chunk its batches below this (client/config), so it bounds the Executor's memory
    without refusing any SDK batch; each datum must also fit its base model's context."""
    max_sampled_tokens: int = 65536
    """num_samples x max_tokens of one sampling request."""
    policy: object = None
    """The operator's job policy (service/policy.py's Policy); None: its safe defaults."""
    alerts_path: str | None = None
    """The service's alerts.jsonl (when `serve` evaluates alert rules), shown to the operator."""
    operator_token: str | None = None
    """The operator's bearer token (LOCKSTEP_OPERATOR_TOKEN for `lockstep serve`): GET /metrics
    answers only it; None: /metrics is off."""


def db(request: Request):
    return request.app.state.sessions()


def config(request: Request) -> ServiceConfig:
    return request.app.state.config


def error_body(message: str, category: str = "user") -> dict:
    return {"error": message, "category": category}


def validation_message(e: RequestValidationError) -> str:
    """What pydantic found, as one line: 'field/path: problem; ...'."""
    parts = ["/".join(str(x) for x in err.get("loc", ()) if x != "body") + f": {err.get('msg')}" for err in e.errors()]
    return "invalid request: " + "; ".join(parts)


AUTH_TTL_S = 5.0
"""How long a verified key is trusted without a store read (a removed tenant's key lives this long)."""
MAX_KEY_CHARS = 256


def tenant_of(request: Request) -> Tenant:
    """The caller's tenant, from X-API-Key (or a Bearer token, for the native job API)."""
    key = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if not key and auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    if key and len(key) > MAX_KEY_CHARS:  # no key of ours; not worth a hash and a store read
        raise Unauthorized("unknown API key")
    # Every SDK call is authenticated; a short cache takes a store read off each request's path.
    cache: dict = request.app.state.auth_cache
    hit = cache.get(key) if key else None
    if hit is not None and hit[1] > time.monotonic():
        return hit[0]
    with db(request) as s:
        tenant = authenticate(s, key)
    if len(cache) > 10_000:
        cache.clear()
    cache[key] = (tenant, time.monotonic() + AUTH_TTL_S)
    return tenant


def ring_workers(request: Request) -> None:
    doorbell.ring(request.app.state.sock, request.app.state.workers.get())


_R = RequestRow.__table__
_RESULT = select(_R.c.id, _R.c.tenant_id, _R.c.state, _R.c.result, _R.c.result_format, _R.c.error,
                 _R.c.error_category).where(_R.c.id == bindparam("rid"))
"""A request's outcome; Core and built once, since every long-poll reads it (see queue.py)."""


def load_request(request: Request, tenant: Tenant, request_id: str):
    with db(request) as s:
        row = s.execute(_RESULT, {"rid": request_id}).first()
        if row is None or row.tenant_id != tenant.id:
            raise NotFound(f"unknown request_id {request_id!r}")
        return row


async def wait_for_result(request: Request, tenant: Tenant, request_id: str):
    """Long-poll: the row once it is done or failed, or as it stands after poll_timeout_s."""
    cfg = config(request)
    waiters: doorbell.Waiters = request.app.state.waiters
    deadline = time.monotonic() + cfg.poll_timeout_s
    while True:
        ev = waiters.wait_for(request_id)
        try:
            row = await run_in_threadpool(load_request, request, tenant, request_id)
            if row.state in (RequestState.DONE.value, RequestState.FAILED.value):
                return row
            left = deadline - time.monotonic()
            if left <= 0:
                return row
            try:
                await asyncio.wait_for(ev.wait(), min(left, cfg.fallback_poll_s))
            except asyncio.TimeoutError:
                pass
        finally:
            waiters.forget(request_id, ev)


def result_response(row) -> Response:
    if row.state == RequestState.FAILED.value:
        return JSONResponse(error_body(row.error or "request failed", row.error_category or "server"))
    if row.state != RequestState.DONE.value:
        return JSONResponse({"type": "try_again", "request_id": row.id, "queue_state": "active"})
    if row.result_format == "proto":
        return Response(row.result, media_type="application/x-protobuf")
    return Response(row.result, media_type="application/json")
