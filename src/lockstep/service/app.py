"""The API process: FastAPI app factory, body-size limit, auth, error mapping, long-polls.

It holds no ML state and never imports torch: requests become rows in the store and results are
read back from it. Every error a user can cause maps to a 4xx with a message; anything else is a
500 whose body names an incident id (logged with the traceback), never a stack trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy import bindparam, select
from starlette.concurrency import run_in_threadpool

from lockstep.service import doorbell
from lockstep.service.db import Request as RequestRow
from lockstep.service.db import Tenant, connect
from lockstep.service.storage import Storage
from lockstep.service.tenants import authenticate
from lockstep.service.types import NotFound, RequestState, ServiceError

log = logging.getLogger("lockstep.service")


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
    policy: object = None
    """The operator's job policy (service/policy.py's Policy); None: its safe defaults."""


class BodyLimit:
    """ASGI middleware: refuse bodies over the limit (by Content-Length, or while streaming)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send):
        body = (f'{{"error": "request body exceeds {self.max_bytes} bytes", "category": "user"}}').encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def error_body(message: str, category: str = "user") -> dict:
    return {"error": message, "category": category}


def create_app(config: ServiceConfig) -> FastAPI:
    from lockstep.service.jobs_api import router as jobs_router
    from lockstep.service.tinker_api import router as tinker_router

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.transport = await doorbell.listen(app.state.sock, app.state.waiters)
        with sessions() as s:
            doorbell.register(s, "api", app.state.instance, app.state.sock)
        yield
        app.state.transport.close()

    app = FastAPI(title="lockstep", docs_url="/docs", openapi_url="/openapi.json", lifespan=lifespan)
    engine, sessions = connect(config.db_url)
    app.state.config, app.state.engine, app.state.sessions = config, engine, sessions
    app.state.storage = Storage(config.storage_url)
    app.state.waiters = doorbell.Waiters()
    app.state.instance = f"api-{uuid.uuid4().hex[:12]}"
    app.state.sock = doorbell.bind()
    app.state.workers = doorbell.AddressBook(sessions, "worker")
    app.state.auth_cache = {}

    @app.exception_handler(ServiceError)
    async def _service_error(_req, e: ServiceError):
        return JSONResponse(error_body(str(e), e.category), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, e: RequestValidationError):
        parts = ["/".join(str(x) for x in err.get("loc", ()) if x != "body") + f": {err.get('msg')}" for err in e.errors()]
        return JSONResponse(error_body("invalid request: " + "; ".join(parts)), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(_req, e: Exception):
        incident = uuid.uuid4().hex[:12]
        log.exception("internal error %s", incident)
        return JSONResponse(error_body(f"internal error (incident {incident})", "server"), status_code=500)

    app.include_router(tinker_router, prefix="/api/v1")
    app.include_router(jobs_router, prefix="/v1")
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    return app


# -- helpers shared by the routers ---------------------------------------------------------------
def db(request: Request):
    return request.app.state.sessions()


AUTH_TTL_S = 5.0
"""How long a verified key is trusted without a store read (a removed tenant's key lives this long)."""


def tenant_of(request: Request) -> Tenant:
    """The caller's tenant, from X-API-Key (or a Bearer token, for the native job API)."""
    key = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if not key and auth.lower().startswith("bearer "):
        key = auth[7:].strip()
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
    cfg: ServiceConfig = request.app.state.config
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
