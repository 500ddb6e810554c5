"""Expiring signed download URLs: external weights files and session traces, fetched with no API key.

A URL names exactly one object and an expiry, and carries an HMAC-SHA256 over both with a secret
the API instances share (the store's `server_secrets` row, generated on first use): changing the
object, the expiry or the signature makes it a 403, and so does the clock passing the expiry.
On S3 (and any fsspec backend that can sign) a storage object's URL is the store's own presigned
URL instead, which expires the same way; the local backend (and traces, which the API renders on
demand rather than store) go through GET /api/v1/signed here.

Written by hand (hmac + base64 from the standard library): itsdangerous and friends sign a
payload, but the verification we need is this small, and a constant-time compare is all it asks.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import hmac
import posixpath
import secrets
import time
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from sqlalchemy.exc import IntegrityError

from lockstep.service import session_trace
from lockstep.service.db import ServerSecret
from lockstep.service.types import ServiceError

URL_TTL_S = 3600
"""How long a signed URL stays valid (the SDK re-signs when fewer than 5 minutes are left)."""
SECRET_NAME = "signed_urls"
STORAGE, TRACE = "storage", "trace"
"""What an object names: a storage key (a file of a checkpoint) or a session whose trace is rendered."""

router = APIRouter()
clock = time.time
"""Unix seconds now (a test moves it past an expiry rather than wait for one)."""


class Forbidden(ServiceError):
    status = 403


def secret(sessions) -> bytes:
    """The shared signing secret; the first API instance to need it creates it (a racing one reads
    the winner's). Deleting the row invalidates every URL signed so far."""
    with sessions() as s:
        row = s.get(ServerSecret, SECRET_NAME)
        if row is None:
            s.add(ServerSecret(name=SECRET_NAME, value=secrets.token_hex(32)))
            try:
                s.commit()
            except IntegrityError:
                s.rollback()
            row = s.get(ServerSecret, SECRET_NAME)
        return bytes.fromhex(row.value)


def _mac(key: bytes, obj: str, expires: int) -> str:
    return hmac.new(key, f"{obj}\n{expires}".encode(), hashlib.sha256).hexdigest()


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _unb64(text: str) -> str:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise Forbidden("invalid signed URL: its object is not valid base64") from None


def expiry(ttl_s: int = URL_TTL_S) -> int:
    return int(clock()) + ttl_s


def sign(request: Request, kind: str, name: str, expires: int) -> str:
    """A URL of this API that serves `kind:name` until `expires` (unix seconds)."""
    obj = f"{kind}:{name}"
    query = urlencode({"o": _b64(obj), "e": expires, "s": _mac(secret(request.app.state.sessions), obj, expires)})
    return f"{str(request.base_url).rstrip('/')}/api/v1/signed?{query}"


def storage_url(request: Request, key: str, expires: int) -> str:
    """A URL for one storage object: the backend's own presigned URL where it has one (S3)."""
    storage = request.app.state.storage
    if not storage.local:
        url = storage.presign(key, expires - int(clock()))
        if url is not None:
            return url
    return sign(request, STORAGE, key, expires)


def verify(sessions, o: str, e: int, s: str) -> tuple[str, str]:
    """(kind, name) of a signed URL's object; Forbidden if it was altered or has expired."""
    obj = _unb64(o)
    # compare_digest refuses str with non-ASCII characters (a TypeError): compare bytes.
    if not hmac.compare_digest(_mac(secret(sessions), obj, e).encode(), s.encode("utf-8", "surrogatepass")):
        raise Forbidden("invalid signed URL: the signature does not match (ask for a new URL)")
    if clock() >= e:
        raise Forbidden("this signed URL has expired; ask for a new one")
    kind, _, name = obj.partition(":")
    if kind not in (STORAGE, TRACE) or not name:
        raise Forbidden("invalid signed URL")
    return kind, name


def iso(expires: int) -> str:
    return dt.datetime.fromtimestamp(expires, dt.timezone.utc).isoformat()


@router.get("/signed")
def download(request: Request, o: str = Query(max_length=2048), e: int = Query(ge=0, le=2**40),
             s: str = Query(max_length=64)):
    """No API key: the URL is the credential."""
    kind, name = verify(request.app.state.sessions, o, e, s)
    if kind == TRACE:  # rendered now, never stored
        return JSONResponse(session_trace.render(request.app.state.sessions, name),
                            headers={"Content-Disposition": f'attachment; filename="{name}.json"'})
    storage = request.app.state.storage
    if not storage.exists(name):
        raise Forbidden("the object this URL names no longer exists")
    filename = posixpath.basename(name)
    if storage.local:
        return FileResponse(storage.path(name), filename=filename)
    return StreamingResponse(_chunks(storage, name), media_type="application/octet-stream",
                             headers={"Content-Disposition": f'attachment; filename="{filename}"'})


def _chunks(storage, key: str, size: int = 1 << 20):
    with storage.open(key) as f:
        while chunk := f.read(size):
            yield chunk
