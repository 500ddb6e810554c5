"""Datasets under /v1: a tenant's data files for jobs, uploaded as a raw request body.

`POST /v1/datasets?name=train.jsonl` stores the body (jsonl: one JSON object per line; parquet:
a file pyarrow reads through) under a key the server generates, within the policy's size cap and
the tenant's quota, and answers its id (`ds-...`); a job spec names it in `env.path`,
`env.test_path` or `stages[].dataset`, and the scheduler copies it into the job's run directory.
A dataset is only ever reached by its id and its tenant: the uploader's name is a label.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import uuid
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy import func, select
from starlette.concurrency import run_in_threadpool

from lockstep.service.deps import db, tenant_of
from lockstep.service.db import Dataset, Job, Tenant
from lockstep.service.policy import DATASET_ID, Limits, data_fields
from lockstep.service.types import JobState, NotFound, QuotaExceeded, ServiceError

router = APIRouter()
TENANT = Depends(tenant_of)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._()+-]{0,127}")
PARQUET_EXPANSION = 8
"""A parquet file may decompress to at most this many times max_dataset_bytes (a zip bomb is refused
from its metadata, before any page is read)."""


def limits_of(request: Request, t: Tenant) -> Limits:
    from lockstep.service.policy import Policy

    return (request.app.state.config.policy or Policy()).for_tenant(t.name)


def dataset_json(ds: Dataset) -> dict:
    return {"id": ds.id, "name": ds.name, "format": ds.format, "size_bytes": ds.size_bytes, "num_rows": ds.num_rows,
            "sha256": ds.sha256, "created_at": ds.created_at.isoformat()}


def _dataset(s, t: Tenant, dataset_id: str) -> Dataset:
    ds = s.get(Dataset, dataset_id) if DATASET_ID.fullmatch(dataset_id) else None
    if ds is None or ds.tenant_id != t.id:
        raise NotFound(f"unknown dataset {dataset_id[:100]!r}")
    return ds


@router.post("/datasets")
async def upload(request: Request, name: str = Query(min_length=1, max_length=128),
                 format: Literal["jsonl", "parquet"] | None = None, t: Tenant = TENANT) -> dict:
    """The request body is the file, sent as is (`curl --data-binary @train.jsonl`)."""
    if not NAME.fullmatch(name):
        raise ServiceError(f"name {name!r}: use letters, digits, spaces and ._()+- (a label, not a path)")
    fmt = format or next((f for f in ("jsonl", "parquet") if name.endswith("." + f)), None)
    if fmt is None:
        raise ServiceError(f"name {name!r}: cannot tell the format; end it in .jsonl or .parquet, or pass ?format=")
    limits = limits_of(request, t)
    fd, tmp = tempfile.mkstemp(prefix="lockstep-upload-")
    try:
        size, digest = 0, hashlib.sha256()
        with os.fdopen(fd, "wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_dataset_bytes:
                    raise ServiceError(f"dataset is larger than this server's cap max_dataset_bytes = "
                                       f"{limits.max_dataset_bytes}", status=413)
                digest.update(chunk)
                f.write(chunk)
        return await run_in_threadpool(_store, request, t, limits, name, fmt, tmp, size, digest.hexdigest())
    finally:
        os.unlink(tmp)


def _store(request: Request, t: Tenant, limits: Limits, name: str, fmt: str, tmp: str, size: int, sha: str) -> dict:
    rows = validate_file(tmp, fmt, limits)
    storage = request.app.state.storage
    ds = Dataset(id=f"ds-{uuid.uuid4().hex[:16]}", tenant_id=t.id, name=name, format=fmt, size_bytes=size,
                 num_rows=rows, sha256=sha, storage_key="")
    ds.storage_key = f"datasets/{t.id}/{ds.id}.{fmt}"
    storage.put_file(tmp, ds.storage_key)  # before the row: a row always has its file
    try:
        with db(request) as s:
            # The row goes in first: its INSERT takes the store's write lock (SQLite) and the tenant
            # row lock serialises PostgreSQL, so two uploads cannot both pass the quota.
            s.execute(select(Tenant.id).where(Tenant.id == t.id).with_for_update())
            s.add(ds)
            s.flush()
            count, used = s.execute(select(func.count(), func.coalesce(func.sum(Dataset.size_bytes), 0))
                                    .where(Dataset.tenant_id == t.id)).one()
            if count > limits.max_datasets:
                raise QuotaExceeded(f"tenant {t.name!r} has {count - 1} datasets (at most {limits.max_datasets}); "
                                    f"delete some with DELETE /v1/datasets/ID")
            if used > limits.dataset_quota_bytes:
                raise QuotaExceeded(f"tenant {t.name!r} would store {used} bytes of datasets (quota "
                                    f"dataset_quota_bytes = {limits.dataset_quota_bytes}); delete some first")
            s.commit()
            return dataset_json(ds)
    except BaseException:
        storage.delete(ds.storage_key)
        raise


def validate_file(path: str, fmt: str, limits: Limits) -> int:
    """Rows of a jsonl or parquet file; ServiceError saying what is wrong otherwise."""
    rows = _jsonl_rows(path) if fmt == "jsonl" else _parquet_rows(path, limits)
    if rows == 0:
        raise ServiceError(f"dataset has no rows; a {fmt} file of rows is expected")
    return rows


def _jsonl_rows(path: str) -> int:
    rows = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise ServiceError(f"dataset line {number}: not UTF-8 text") from None
            except (ValueError, RecursionError) as e:
                raise ServiceError(f"dataset line {number}: invalid JSON ({str(e)[:200]})") from None
            if not isinstance(row, dict):
                raise ServiceError(f"dataset line {number}: expected a JSON object, got {type(row).__name__}")
            rows += 1
    return rows


def _parquet_rows(path: str, limits: Limits) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
        meta = f.metadata
        expanded = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        if expanded > PARQUET_EXPANSION * limits.max_dataset_bytes:
            raise ServiceError(f"parquet dataset expands to {expanded} bytes (at most "
                               f"{PARQUET_EXPANSION} x max_dataset_bytes = {PARQUET_EXPANSION * limits.max_dataset_bytes})")
        for _ in f.iter_batches(batch_size=4096):  # every page decodes, or the upload is refused
            pass
        return meta.num_rows
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ServiceError(f"not a readable parquet file: {str(e)[:200]}") from None


@router.get("/datasets")
def list_datasets(request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        q = select(Dataset).where(Dataset.tenant_id == t.id).order_by(Dataset.created_at)
        return {"datasets": [dataset_json(ds) for ds in s.scalars(q)]}


@router.get("/datasets/{dataset_id}")
def get_dataset(dataset_id: str, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        return dataset_json(_dataset(s, t, dataset_id))


@router.delete("/datasets/{dataset_id}")
def delete_dataset(dataset_id: str, request: Request, t: Tenant = TENANT) -> dict:
    with db(request) as s:
        ds = _dataset(s, t, dataset_id)
        live = [state for state in JobState if not state.terminal]
        for job in s.scalars(select(Job).where(Job.tenant_id == t.id, Job.state.in_([x.value for x in live]))):
            if any(value == ds.id for _, value in data_fields(job.spec)):
                raise ServiceError(f"dataset {ds.id} is used by job {job.id} ({job.state}); delete it once that job ends",
                                   status=409)
        s.delete(ds)
        s.commit()
    request.app.state.storage.delete(ds.storage_key)
    return {"id": ds.id, "deleted": True}
