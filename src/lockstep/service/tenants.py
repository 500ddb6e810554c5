"""Tenants and their API keys. A key is shown once at creation; only its sha256 is stored.

Keys look like `tml-<random>` because the Tinker SDK refuses keys without that prefix.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid

from sqlalchemy import bindparam, func, select, update

from lockstep.service.db import Model, Tenant
from lockstep.service.types import Conflict, NotFound, QuotaExceeded, ServiceError, Unauthorized

KEY_PREFIX = "tml-"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def create_tenant(session, name: str, *, max_concurrent_jobs: int = 2, max_models: int = 16) -> tuple[Tenant, str]:
    """A new tenant and its API key (the only time the key exists in clear)."""
    if not NAME_RE.fullmatch(name or ""):
        raise ServiceError(f"tenant name {name!r}: use 1-64 letters, digits, '_', '.', '-', starting with a letter or digit")
    if session.scalar(select(Tenant).where(Tenant.name == name)) is not None:
        raise Conflict(f"tenant {name!r} already exists")
    key = new_key()
    tenant = Tenant(id=uuid.uuid4().hex, name=name, key_hash=hash_key(key), max_concurrent_jobs=max_concurrent_jobs,
                    max_models=max_models)
    session.add(tenant)
    session.commit()
    return tenant, key


def rotate_key(session, name: str) -> str:
    """A new API key for tenant `name` (shown once); the old one, or a revoked one, stops working
    (API processes that cached it accept it for deps.AUTH_TTL_S more)."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise NotFound(f"no tenant {name!r} (list them in the store, or create one with `lockstep tenants create`)")
    key = new_key()
    tenant.key_hash = hash_key(key)
    session.commit()
    return key


def authenticate(session, key: str | None) -> Tenant:
    if not key:
        raise Unauthorized("missing API key: send it in the X-API-Key header (create one with `lockstep tenants create`)")
    tenant = session.scalar(select(Tenant).where(Tenant.key_hash == hash_key(key)))
    if tenant is None:
        raise Unauthorized("unknown API key")
    return tenant


_T, _M = Tenant.__table__, Model.__table__
# A write that changes nothing: it takes the tenant's row lock (PostgreSQL) or the database's write
# lock (SQLite) until the transaction ends, and reads the quota fresh (the key may be cached).
_LOCK_QUOTA = update(_T).where(_T.c.id == bindparam("tid")).values(max_models=_T.c.max_models).returning(
    _T.c.max_models)
_MODELS = select(func.count()).select_from(_M).where(_M.c.tenant_id == bindparam("tid"))


def lock_quota(session, tenant_id: str) -> int:
    """The tenant's model quota, read fresh, with the tenant's models held still until the caller
    commits: counting and then inserting without this lock let concurrent creations overshoot."""
    return session.execute(_LOCK_QUOTA, {"tid": tenant_id}).scalar_one()


def check_model_quota(session, tenant: Tenant, quota: int) -> None:
    """429 if one more model would exceed `quota` (call under lock_quota)."""
    count = session.execute(_MODELS, {"tid": tenant.id}).scalar_one()
    if count >= quota:
        raise QuotaExceeded(f"tenant {tenant.name!r} already has {count} models (quota {quota})")
