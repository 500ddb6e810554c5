"""Datasets under /v1: a tenant's data files for jobs, uploaded as a raw request body.

`POST /v1/datasets?name=train.jsonl` stores the body (jsonl: one JSON object per line; parquet:
a file pyarrow reads through) under a key the server generates, within the policy's size cap, its
cap on decoded bytes (checked by decoding it in a bounded process: `service/datacheck.py`) and the
tenant's quota, and answers its id (`ds-...`); a job spec names it in `env.path`,
`env.test_path` or `stages[].dataset`, and the scheduler copies it into the job's run directory.
A dataset is only ever reached by its id and its tenant: the uploader's name is a label.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import uuid
from typing import Literal

import anyio
from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy import func, select
from starlette.concurrency import run_in_threadpool

from lockstep.service.datacheck import CHECK_CPU_S, CHECK_MEMORY_BYTES
from lockstep.service.db import Dataset, Job, Tenant
from lockstep.service.deps import db, tenant_of
from lockstep.service.policy import DATASET_ID, Limits, data_fields
from lockstep.service.types import JobState, NotFound, QuotaExceeded, ServiceError

router = APIRouter()
TENANT = Depends(tenant_of)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._()+-]{0,127}")
MAX_CHECKS = 2
"""Uploads checked at once, each in a process of up to CHECK_MEMORY_BYTES; more wait their turn."""
log = logging.getLogger(__name__)


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
        rows = await check_file(request.app, tmp, fmt, limits)
        return await run_in_threadpool(_store, request, t, limits, name, fmt, tmp, size, digest.hexdigest(), rows)
    finally:
        os.unlink(tmp)


def _store(request: Request, t: Tenant, limits: Limits, name: str, fmt: str, tmp: str, size: int, sha: str,
           rows: int) -> dict:
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


async def check_file(app, path: str, fmt: str, limits: Limits) -> int:
    """Rows of an uploaded file, decoded in a bounded process of its own (`service/datacheck.py`);
    ServiceError saying what is wrong otherwise. At most MAX_CHECKS run at once; the rest wait
    without holding a thread."""
    slots = getattr(app.state, "dataset_checks", None)
    if slots is None:
        slots = app.state.dataset_checks = anyio.Semaphore(MAX_CHECKS)
    command = [sys.executable, "-B", "-m", "lockstep.service.datacheck", path, fmt,
               str(limits.max_dataset_decoded_bytes), str(CHECK_MEMORY_BYTES)]
    try:
        async with slots:
            done = await anyio.run_process(command, check=False)
    except OSError as e:
        raise ServiceError(f"cannot check datasets right now ({e.strerror}); try again later", status=503) from None
    verdict = _verdict(done)
    if "refused" in verdict:
        raise ServiceError(str(verdict["refused"]))
    if verdict["rows"] == 0:
        raise ServiceError(f"dataset has no rows; a {fmt} file of rows is expected")
    return verdict["rows"]


def _verdict(done: subprocess.CompletedProcess) -> dict:
    """The check's answer; a check that died without one (killed past its CPU time, crashed in the
    reader on a crafted file) refuses the file, and the operator's log says why."""
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    try:
        verdict = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    except ValueError:
        verdict = None
    if isinstance(verdict, dict) and ("refused" in verdict or isinstance(verdict.get("rows"), int)):
        return verdict
    log.warning("dataset check exited with %s: %s", done.returncode, done.stderr.decode(errors="replace")[-2000:])
    if done.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return {"refused": f"dataset takes more than {CHECK_CPU_S} s of CPU time to decode"}
    if b"MemoryError" in done.stderr:
        return {"refused": f"dataset needs more than {CHECK_MEMORY_BYTES} bytes of memory to decode"}
    return {"refused": f"dataset could not be read: the check stopped with exit status {done.returncode}"}


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
