"""The API process: assembles the FastAPI app from the routers, with the body-size limit, the
security headers, the error mapping, the doorbell and the job events' notifier.

It holds no ML state and never imports torch: requests become rows in the store and results are
read back from it. Every error a user can cause maps to a 4xx with a message; anything else is a
500 whose body names an incident id (logged with the traceback), never a stack trace. What the
routers share lives in deps.py, which they import; this module only assembles.
"""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from urllib.parse import unquote_to_bytes

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException

from lockstep.service import doorbell
from lockstep.service.db import connect
from lockstep.service.deps import ServiceConfig, error_body, validation_message
from lockstep.service.notifier import JobNotifier, StreamSlots
from lockstep.service.policy import Policy
from lockstep.service.prometheus import HttpMetrics, Metrics
from lockstep.service.storage import Storage
from lockstep.service.types import NotFound, ServiceError, Unauthorized

from lockstep.service import (datasets, jobs_api, operator_api, signed_urls, tinker_admin, tinker_api,
                              tinker_checkpoints, tinker_rest, trace_api, ui)

__all__ = ["ServiceConfig", "create_app"]
log = logging.getLogger("lockstep.service")


class BodyLimit:
    """ASGI middleware: refuse bodies over the limit with 413, by Content-Length or while streaming
    (a chunked body has none). Past the limit it answers itself and tells the app the client left,
    so the app stops reading and whatever it answers then is dropped."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send)
        seen, refused = 0, False

        async def limited():
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    refused = True
                    await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message):
            if not refused:
                await send(message)

        try:
            await self.app(scope, limited, guarded)
        except Exception:
            if not refused:
                raise

    async def _refuse(self, send):
        body = (f'{{"error": "request body exceeds {self.max_bytes} bytes", "category": "user"}}').encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class PrintableTarget:
    """ASGI middleware: a 400 for a URL whose path or query has control characters (%00 and the like)
    once decoded. No id, name or parameter of ours has one, and PostgreSQL refuses NUL in a query
    parameter (a 500 from every route that looks an id up), so they are refused before any route."""

    CONTROL = re.compile(rb"[\x00-\x1f\x7f]")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (self.CONTROL.search(scope["path"].encode("utf-8", "surrogateescape"))
                                        or self.CONTROL.search(unquote_to_bytes(scope.get("query_string", b"")))):
            body = error_body("the URL has control characters (such as %00) in its path or query; no id has any")
            return await JSONResponse(body, status_code=400)(scope, receive, send)
        return await self.app(scope, receive, send)


API_CSP = "default-src 'none'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
"""The API's answers (JSON, artifacts, errors) are never pages: nothing in them loads or runs, and
nothing frames them."""
DOCS_CSP = ("default-src 'none'; script-src 'unsafe-inline' https://cdn.jsdelivr.net; style-src 'unsafe-inline' "
            "https://cdn.jsdelivr.net https://fonts.googleapis.com; font-src https://fonts.gstatic.com; img-src 'self' "
            "data: https://fastapi.tiangolo.com https://cdn.redoc.ly; connect-src 'self'; worker-src blob:; "
            "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
"""FastAPI's /docs and /redoc: its template (no tenant data in it) loads Swagger UI / ReDoc from
its CDN and starts them with an inline script."""


class SecurityHeaders:
    """ASGI middleware: every answer gets `X-Content-Type-Options: nosniff` and `X-Frame-Options:
    DENY`, and a Content-Security-Policy unless it set its own (the /ui pages do, ui.py)."""

    OWN = {"/docs": DOCS_CSP, "/docs/oauth2-redirect": DOCS_CSP, "/redoc": DOCS_CSP}

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        csp = self.OWN.get(scope["path"], API_CSP)

        async def with_headers(message):
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.setdefault("content-security-policy", csp)
                headers["x-frame-options"] = "DENY"
                headers["x-content-type-options"] = "nosniff"
            await send(message)

        await self.app(scope, receive, with_headers)


def create_app(config: ServiceConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.transport = await doorbell.listen(app.state.sock, app.state.waiters)
        with sessions() as s:
            doorbell.register(s, "api", app.state.instance, app.state.sock)
        await app.state.notifier.start()
        yield
        await app.state.notifier.stop()
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
    poll_s = (config.policy or Policy()).limits.event_poll_s
    app.state.notifier = JobNotifier(sessions, every_s=poll_s)  # job event streams (jobs_api.py)
    app.state.event_slots = StreamSlots()

    @app.exception_handler(ServiceError)
    async def _service_error(_req, e: ServiceError):
        return JSONResponse(error_body(str(e), e.category), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, e: RequestValidationError):
        return JSONResponse(error_body(validation_message(e)), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(_req, e: HTTPException):  # unknown routes, wrong methods, unparsable bodies: our error shape
        return JSONResponse(error_body(str(e.detail)), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal(_req, e: Exception):
        incident = uuid.uuid4().hex[:12]
        log.exception("internal error %s", incident)
        return JSONResponse(error_body(f"internal error (incident {incident})", "server"), status_code=500)

    app.state.metrics = Metrics(sessions, config.operator_token)

    @app.get("/metrics", include_in_schema=False)
    def prometheus_metrics(request: Request):
        """The service in Prometheus' text format, for the operator's bearer token only."""
        metrics = request.app.state.metrics
        if not metrics.operator_token:
            raise NotFound("metrics are off: start the server with LOCKSTEP_OPERATOR_TOKEN set, and scrape with "
                           "that token as a bearer token")
        if not metrics.allowed(request.headers.get("authorization")):
            raise Unauthorized("GET /metrics needs the operator's token: Authorization: Bearer <token>")
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    # tinker_checkpoints before tinker_rest: its .../{cid}/publish must match before DELETE .../{cid:path}
    rest = ((tinker_checkpoints.router, "/api/v1"), (tinker_rest.router, "/api/v1"), (tinker_admin.router, "/api/v1"),
            (signed_urls.router, "/api/v1"))
    for router, prefix in ((tinker_api.router, "/api/v1"), *rest, (jobs_api.router, "/v1"),
                           (trace_api.router, "/v1"), (operator_api.router, "/v1"), (ui.router, "")):
        app.include_router(router, prefix=prefix)
    for router, prefix in ((tinker_api.router, "/api/v1"), (tinker_api.training, "/api/v1"),  # (and the included ones)
                           *rest, (jobs_api.router, "/v1"), (datasets.router, "/v1"),
                           (trace_api.router, "/v1"), (operator_api.router, "/v1"), (ui.router, "")):
        app.state.metrics.name_routes(router, prefix)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(PrintableTarget)
    app.add_middleware(SecurityHeaders)
    app.add_middleware(HttpMetrics, metrics=app.state.metrics)  # outermost: it counts every answer
    return app
