"""The store: SQLAlchemy 2 tables for tenants, sessions, models, requests, checkpoints, sampling
sessions, jobs, datasets and usage. SQLite by default, PostgreSQL by URL.

Requests are the queue between the API and the workers: the API inserts them, a worker claims one
with a conditional UPDATE (so two workers never run the same request), executes it and writes the
result in the same row. Everything a tenant owns carries its `tenant_id`, and every lookup filters
on it, so another tenant's object is simply not found.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, LargeBinary, String, Text,
                        UniqueConstraint, create_engine, event, inspect, or_, text)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    """sha256 of the API key; the key itself is shown once and never stored."""
    max_concurrent_jobs: Mapped[int] = mapped_column(Integer, default=2)
    max_models: Mapped[int] = mapped_column(Integer, default=16)
    created_at: Mapped[dt.datetime] = mapped_column(default=now)


class BaseModelEntry(Base):
    """A base model the workers can load, registered by name (`lockstep/tiny` always)."""

    __tablename__ = "base_models"
    name: Mapped[str] = mapped_column(String(256), primary_key=True)
    path: Mapped[str] = mapped_column(String(1024))
    """Local Hugging Face directory on the workers (also the tokenizer the SDK is told to load)."""
    arch: Mapped[str] = mapped_column(String(64))
    vocab_size: Mapped[int] = mapped_column(Integer)
    max_context_length: Mapped[int] = mapped_column(Integer)
    registered_at: Mapped[dt.datetime] = mapped_column(default=now)


class Session(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    tags: Mapped[list[Any]] = mapped_column(default=list)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(default=dict)
    sdk_version: Mapped[str] = mapped_column(String(32), default="")
    created_at: Mapped[dt.datetime] = mapped_column(default=now)
    last_heartbeat: Mapped[dt.datetime] = mapped_column(default=now)
    finished_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    finish_reason: Mapped[str | None] = mapped_column(String(32), default=None)
    project_id: Mapped[str | None] = mapped_column(String(128), default=None)
    """A label of the tenant's own (PUT /sessions/{id}/project); projects are not shared between tenants."""


class Model(Base):
    """A trainable model (a Tinker training run): id "{session}:train:{n}"."""

    __tablename__ = "models"
    id: Mapped[str] = mapped_column(String(160), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    base_model: Mapped[str] = mapped_column(String(256))
    lora_rank: Mapped[int] = mapped_column(Integer, default=0)
    """0: full fine-tuning."""
    lora_seed: Mapped[int] = mapped_column(Integer, default=0)
    lora_config: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    """The Tinker lora_config as created (rank, seed, train_attn/mlp/unembed); None for full FT."""
    vocab_size: Mapped[int] = mapped_column(Integer)
    """Copied from the base model's config, so the API can validate token ids without the model."""
    user_metadata: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(default=now)
    last_request_time: Mapped[dt.datetime] = mapped_column(default=now)
    state_path: Mapped[str | None] = mapped_column(String(512), default=None)
    """Storage path of the model's last durable state (written at optimizer steps)."""
    state_seq: Mapped[int] = mapped_column(Integer, default=0)
    """The seq_id of the last request whose effect `state_path` includes."""
    done_seq: Mapped[int] = mapped_column(Integer, default=-1)
    """The seq_id of the last finished request; the next one to run is done_seq + 1."""
    copied_from: Mapped[str | None] = mapped_column(String(512), default=None)
    """The tinker:// path copy_weights made this run from: such a run holds checkpoints only and
    cannot be trained on (the SDK's semantics)."""


class Request(Base):
    __tablename__ = "requests"
    __table_args__ = (UniqueConstraint("model_id", "seq_id", name="uq_model_seq"),
                      Index("ix_requests_state", "state", "kind"))
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    model_id: Mapped[str | None] = mapped_column(String(160), index=True, default=None)
    """The model a training request applies to; for sampling, the sampling session's source."""
    sampling_session_id: Mapped[str | None] = mapped_column(String(160), default=None)
    seq_id: Mapped[int | None] = mapped_column(Integer, default=None)
    """Per-model order (training requests); NULL for sampling."""
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    payload_format: Mapped[str] = mapped_column(String(8), default="json")
    payload_sha: Mapped[str] = mapped_column(String(64))
    """A retry with the same (model_id, seq_id) and payload gets the same request back."""
    state: Mapped[str] = mapped_column(String(16), default="queued")
    result: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    result_format: Mapped[str | None] = mapped_column(String(8), default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    error_category: Mapped[str | None] = mapped_column(String(16), default=None)
    claimed_by: Mapped[str | None] = mapped_column(String(64), default=None)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Claims so far; a request whose executor died under it this many times is failed, not requeued."""
    created_at: Mapped[dt.datetime] = mapped_column(default=now)
    claimed_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    finished_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    order: Mapped[int] = mapped_column(BigInteger, index=True)
    """Arrival order (monotonic per store), for fair claiming of unordered (sampling) requests."""
    num_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    """What the request puts in a packed batch (service/packing.py), counted by the API: a
    forward(_backward)'s input tokens, a sample's num_samples x (prompt + max_tokens). NULL for
    the kinds that run alone (and rows from before the column: they count as a whole batch)."""


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("model_id", "kind", "name", name="uq_checkpoint"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    model_id: Mapped[str] = mapped_column(String(160), index=True)
    kind: Mapped[str] = mapped_column(String(24))
    """"weights" (state with optimizer) or "sampler_weights"."""
    name: Mapped[str] = mapped_column(String(128))
    storage_path: Mapped[str] = mapped_column(String(512))
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(default=now)
    expires_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    public: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    """Published: any tenant may read it by its tinker:// path (service/tinker_checkpoints.py)."""


def unexpired():
    """A where-clause for the checkpoints not past their `expires_at`. The janitor deletes the
    others within a pass (--janitor-every); to the API they are gone from the moment they expire."""
    return or_(Checkpoint.expires_at.is_(None), Checkpoint.expires_at > now())


class SamplingSession(Base):
    __tablename__ = "sampling_sessions"
    id: Mapped[str] = mapped_column(String(160), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[str] = mapped_column(String(64))
    base_model: Mapped[str] = mapped_column(String(256))
    model_path: Mapped[str | None] = mapped_column(String(512), default=None)
    """The tinker:// path it samples from; NULL for the base model itself."""
    weights_path: Mapped[str | None] = mapped_column(String(512), default=None)
    """Storage path of the pinned weights (a named sampler save, or an ephemeral snapshot)."""
    lora_rank: Mapped[int] = mapped_column(Integer, default=0)
    lora_config: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    vocab_size: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(default=now)
    inflight_of: Mapped[str | None] = mapped_column(String(160), default=None)
    """An inflight client: the id of its training model's inflight target (the sampling session
    `<model>:inflight`, whose weights_path each inflight save moves); it samples the target's
    latest weights, never weights of its own."""


class StabilityRecord(Base):
    """A sampled sequence kept for provenance checks and StableReinforce (`record_stability_info`):
    its prompt, sampled tokens and logprobs, and the weights that sampled it. Kept for a day after
    sampling or after the last training request that names it (service/stability.py)."""

    __tablename__ = "stability_records"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    """The sequence_id the SDK got for it."""
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[str] = mapped_column(String(64))
    sampling_session_id: Mapped[str] = mapped_column(String(160))
    prompt: Mapped[bytes] = mapped_column(LargeBinary)
    """The request's prompt tokens, int32."""
    tokens: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    """Sampled tokens, int32; NULL until the sample request succeeds."""
    logprobs: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    """The sampler's logprob of each sampled token, float32."""
    weights: Mapped[str | None] = mapped_column(String(512), default=None)
    """Storage key of the weights that sampled it (NULL: the base model)."""
    num_tokens: Mapped[int] = mapped_column(Integer)
    """Tokens it counts against the tenant's stability_quota_tokens (prompt + max_tokens)."""
    created_at: Mapped[dt.datetime] = mapped_column(default=now)
    expires_at: Mapped[dt.datetime] = mapped_column(index=True)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    spec: Mapped[dict[str, Any]] = mapped_column()
    priority: Mapped[str] = mapped_column(String(16), default="preemptible")
    state: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    preemptions: Mapped[int] = mapped_column(Integer, default=0)
    interruptions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Attempts its worker's stop or death interrupted (given back, like preempted ones)."""
    next_attempt_at: Mapped[dt.datetime] = mapped_column(default=now)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    """What went wrong, for the tenant: a message, never a traceback (the attempt's log has it)."""
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    run_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    """Running time of the attempts that ended (the policy's max_wall_seconds caps it)."""
    worker_id: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[dt.datetime] = mapped_column(default=now)
    started_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    finished_at: Mapped[dt.datetime | None] = mapped_column(default=None)


class Dataset(Base):
    """A data file a tenant uploaded (POST /v1/datasets); job specs refer to it by id."""

    __tablename__ = "datasets"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    """"ds-" + 16 hex digits, generated by the server."""
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    """The uploader's label (a file name); never used as a path."""
    format: Mapped[str] = mapped_column(String(8))
    """"jsonl" or "parquet"."""
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    num_rows: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    storage_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[dt.datetime] = mapped_column(default=now)


class JobEvent(Base):
    """A job's metric records and state changes, in order (the SSE stream reads these)."""

    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    """"metrics" (a metrics.jsonl record) or "state"."""
    data: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[dt.datetime] = mapped_column(default=now)


class Usage(Base):
    __tablename__ = "usage"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    kind: Mapped[str] = mapped_column(String(24))
    amount: Mapped[float] = mapped_column(Float)
    source: Mapped[str] = mapped_column(String(160), default="")
    """The request or job it was metered for."""
    created_at: Mapped[dt.datetime] = mapped_column(default=now)


class Endpoint(Base):
    """A live API instance or worker and its doorbell address (see service/doorbell.py)."""

    __tablename__ = "endpoints"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    """"api" or "worker"."""
    host: Mapped[str] = mapped_column(String(64))
    port: Mapped[int] = mapped_column(Integer)
    last_seen: Mapped[dt.datetime] = mapped_column(default=now)


class ServerSecret(Base):
    """A secret the API instances share (signed download URLs), generated on first use."""

    __tablename__ = "server_secrets"
    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    value: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[dt.datetime] = mapped_column(default=now)


class Counter(Base):
    """Named monotonic counters (request arrival order)."""

    __tablename__ = "counters"
    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger, default=0)


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    # WAL lets the API read while a worker writes; a busy timeout turns lock contention into waits.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    # In WAL mode NORMAL never corrupts the database; a power cut may lose the last commits, a
    # crashed process loses nothing. FULL would fsync on each of a request's three commits.
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def default_url(home) -> str:
    return f"sqlite:///{home}/service.db"


def connect(url: str) -> tuple[Engine, sessionmaker]:
    """An engine and session factory for `url`, with the tables created if missing."""
    kwargs: dict = {}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
    engine = create_engine(url, pool_pre_ping=True, **kwargs)
    if url.startswith("sqlite"):
        event.listen(engine, "connect", _sqlite_pragmas)
    Base.metadata.create_all(engine)
    _add_missing_columns(engine)
    return engine, sessionmaker(engine, expire_on_commit=False)


ADDED_COLUMNS = {"requests": ("attempts", "num_tokens"), "jobs": ("run_seconds", "interruptions"),
                 "sessions": ("project_id",), "models": ("copied_from",), "checkpoints": ("public",),
                 "sampling_sessions": ("inflight_of",)}
"""Columns added after their table was first released: create_all() creates missing tables, not
missing columns, so a store made by an older version gets them here (with their server default).
Additive changes only; anything else would need a real migration tool (Alembic)."""


def _add_missing_columns(engine: Engine) -> None:
    have = inspect(engine)
    for table, columns in ADDED_COLUMNS.items():
        present = {c["name"] for c in have.get_columns(table)}
        for name in columns:
            if name in present:
                continue
            col = Base.metadata.tables[table].c[name]
            ddl = f"ALTER TABLE {table} ADD COLUMN {name} {col.type.compile(engine.dialect)}"
            if col.server_default is not None:
                ddl += f" NOT NULL DEFAULT {col.server_default.arg}"
            try:
                with engine.begin() as conn:
                    conn.execute(text(ddl))
            except DBAPIError:  # another process (the API, a worker) added it first
                if name not in {c["name"] for c in inspect(engine).get_columns(table)}:
                    raise
