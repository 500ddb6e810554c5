"""The request queue in the store: submit (idempotent on (model_id, seq_id)), claim, finish.

The API submits and long-polls; workers claim and finish. Training requests of a model run strictly
in seq_id order: a worker only claims seq_id == done_seq + 1, so chunks that arrive out of order
(the SDK posts the first chunk of a batch last) wait for their turn. Sampling requests carry no
seq_id and are claimed in arrival order. A training request the API refuses once its model and
seq_id are known is stored as a row that is already failed (`refuse`); done_seq passes over such a
row when its turn comes, so a refused request never stalls the requests after it.

Every SDK call passes through here three times, so the statements are Core, built once with bind
parameters: ORM objects and per-call statement construction cost more CPU than the SQL itself, and
on a small box that CPU is taken from the engine (BENCHMARKS.md §8).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import uuid
from dataclasses import dataclass

from sqlalchemy import and_, bindparam, case, exists, func, insert, literal, null, select, union_all, update
from sqlalchemy.exc import IntegrityError

from lockstep.service.db import Counter, Endpoint, Model, Request, SamplingSession, Tenant, now
from lockstep.service.types import Conflict, RequestKind, RequestState

TRAINING_KINDS = tuple(k.value for k in RequestKind if k is not RequestKind.SAMPLE)
_R, _M, _C, _S, _T = (Request.__table__, Model.__table__, Counter.__table__, SamplingSession.__table__,
                      Tenant.__table__)
_QUEUED, _RUNNING, _FAILED = RequestState.QUEUED.value, RequestState.RUNNING.value, RequestState.FAILED.value


@dataclass(frozen=True)
class Queued:
    """A submitted request, as the API answers it."""

    id: str


@dataclass(frozen=True)
class Claimed:
    """A request a worker owns until it finishes it: what it needs to execute it."""

    id: str
    tenant_id: str
    kind: str
    model_id: str | None
    seq_id: int | None
    sampling_session_id: str | None
    payload: bytes
    attempts: int
    """This claim included: how many executors have taken it."""


_BY_MODEL_SEQ = select(_R.c.id, _R.c.kind, _R.c.payload_sha, _R.c.state).where(
    _R.c.model_id == bindparam("mid"), _R.c.seq_id == bindparam("seq"))
_NEXT_ORDER = (update(_C).where(_C.c.name == "requests").values(value=_C.c.value + 1).returning(_C.c.value))
_INSERT = insert(_R)
_RUNNABLE_TRAINING = (select(_R.c.id, _R.c.order, _R.c.model_id, _R.c.seq_id, _R.c.kind)
                      .join(_M, _M.c.id == _R.c.model_id)
                      .where(_R.c.state == _QUEUED, _R.c.kind.in_(TRAINING_KINDS), _R.c.seq_id == _M.c.done_seq + 1)
                      .order_by(_R.c.order).limit(bindparam("n")))
_RUNNABLE_SAMPLING = (select(_R.c.id, _R.c.order, _R.c.model_id, _R.c.seq_id, _R.c.kind)
                      .where(_R.c.state == _QUEUED, _R.c.kind == RequestKind.SAMPLE.value)
                      .order_by(_R.c.order).limit(bindparam("n")))
_HEAD_COLUMNS = (_R.c.id, _R.c.tenant_id, _R.c.kind, _R.c.num_tokens, _R.c.order)
_HEADS_UNION = union_all(
    select(*_HEAD_COLUMNS, _R.c.model_id, _M.c.base_model.label("base"))
    .join(_M, _M.c.id == _R.c.model_id)
    .where(_R.c.state == _QUEUED, _R.c.kind.in_(TRAINING_KINDS), _R.c.seq_id == _M.c.done_seq + 1),
    # A sampling request holds no model's order (its model_id names the session's source only).
    select(*_HEAD_COLUMNS, null().label("model_id"), func.coalesce(_S.c.base_model, literal("")).label("base"))
    .outerjoin(_S, _S.c.id == _R.c.sampling_session_id)
    .where(_R.c.state == _QUEUED, _R.c.kind == RequestKind.SAMPLE.value)).subquery()
_HEADS_RANKED = select(_HEADS_UNION, func.row_number().over(partition_by=_HEADS_UNION.c.tenant_id,
                                                            order_by=_HEADS_UNION.c.order).label("rank")).subquery()
# An outer join: a row whose tenant is gone (written behind the API's back) is still claimed, and
# fails alone at its commit; its tenant id stands for the name it no longer has.
_HEADS = (select(_HEADS_RANKED.c.id, func.coalesce(_T.c.name, _HEADS_RANKED.c.tenant_id).label("tenant"),
                 _HEADS_RANKED.c.kind, _HEADS_RANKED.c.base, _HEADS_RANKED.c.num_tokens, _HEADS_RANKED.c.order,
                 _HEADS_RANKED.c.model_id)
          .outerjoin(_T, _T.c.id == _HEADS_RANKED.c.tenant_id)
          .where(_HEADS_RANKED.c.rank <= bindparam("per_tenant")).order_by(_HEADS_RANKED.c.order))
_CLAIMED = (_R.c.id, _R.c.tenant_id, _R.c.kind, _R.c.model_id, _R.c.seq_id, _R.c.sampling_session_id, _R.c.payload,
            _R.c.attempts)
_CLAIM = (update(_R).where(and_(_R.c.id == bindparam("rid"), _R.c.state == _QUEUED))
          .values(state=_RUNNING, claimed_by=bindparam("worker"), claimed_at=bindparam("at"), attempts=_R.c.attempts + 1)
          .returning(*_CLAIMED))
# The same compare-and-set over a batch, in one statement. On PostgreSQL the rows are locked first,
# in id order and skipping those another executor's claim holds (two claims locking overlapping
# batches in different orders would deadlock); a row another executor moved out of "queued" first is
# not matched (the condition is re-checked on the row's newest version). SQLite has no row locks
# (FOR UPDATE compiles to nothing): its writers are serial, so the update alone is atomic.
_LOCK_QUEUED = (select(_R.c.id).where(_R.c.id.in_(bindparam("rids", expanding=True)), _R.c.state == _QUEUED)
                .order_by(_R.c.id).with_for_update(skip_locked=True))
_CLAIM_BATCH = (update(_R).where(_R.c.id.in_(_LOCK_QUEUED.scalar_subquery()), _R.c.state == _QUEUED)
                .values(state=_RUNNING, claimed_by=bindparam("worker"), claimed_at=bindparam("at"),
                        attempts=_R.c.attempts + 1)
                .returning(*_CLAIMED))
# Fenced: only the claimant of a still-running request finishes it, so an executor whose claim was
# requeued behind its back (it outlived its lease) cannot write a result the requeued run also writes.
_FINISH = (update(_R).where(_R.c.id == bindparam("rid"), _R.c.state == _RUNNING, _R.c.claimed_by == bindparam("worker"))
           .values(state=bindparam("st"), result=bindparam("res"), result_format=bindparam("fmt"),
                   error=bindparam("err"), error_category=bindparam("cat"), finished_at=bindparam("at"))
           .returning(_R.c.kind, _R.c.model_id, _R.c.seq_id))
_ADVANCE = (update(_M).where(_M.c.id == bindparam("mid"))
            .values(done_seq=case((_M.c.done_seq < bindparam("seq"), bindparam("seq")), else_=_M.c.done_seq),
                    last_request_time=bindparam("at")))
# A failed row at done_seq + 1 can only be one the API refused (a worker's failure advances done_seq
# as it finishes), so the model's order steps over it.
_PASS_REFUSED = (update(_M).where(_M.c.id == bindparam("mid"),
                                  exists().where(_R.c.model_id == _M.c.id, _R.c.seq_id == _M.c.done_seq + 1,
                                                 _R.c.state == _FAILED))
                 .values(done_seq=_M.c.done_seq + 1))
_LOCK_MODEL = select(_M.c.id).where(_M.c.id == bindparam("mid")).with_for_update()
_UNKNOWN = object()


def _next_order(session) -> int:
    value = session.execute(_NEXT_ORDER).scalar()
    if value is not None:
        return value
    try:  # the store's first request; a savepoint, so losing the race to another API keeps our work
        with session.begin_nested():
            session.execute(insert(_C), {"name": "requests", "value": 1})
        return 1
    except IntegrityError:
        return session.execute(_NEXT_ORDER).scalar()


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def holder(session, model_id: str, seq_id: int):
    """The request that holds (model_id, seq_id) already, or None: (id, kind, payload_sha, state)."""
    return session.execute(_BY_MODEL_SEQ, {"mid": model_id, "seq": seq_id}).first()


def submit(session, *, tenant_id: str, kind: RequestKind, payload: bytes, payload_format: str = "json",
           model_id: str | None = None, seq_id: int | None = None, sampling_session_id: str | None = None,
           request_id: str | None = None, held=_UNKNOWN, num_tokens: int | None = None) -> Queued:
    """Queue a request and commit; a retry of the same (model_id, seq_id) with the same payload
    returns the original request, a different payload is a 409. `held`: what `holder` returned,
    when the caller has looked already; `num_tokens`: its size in a packed batch (db.Request)."""
    sha = digest(payload)
    keyed = model_id is not None and seq_id is not None
    if keyed:
        existing = holder(session, model_id, seq_id) if held is _UNKNOWN else held
        if existing is not None:
            return _same_or_conflict(existing, kind, sha, model_id, seq_id)
    rid = request_id or uuid.uuid4().hex
    try:
        session.execute(_INSERT, {"id": rid, "tenant_id": tenant_id, "kind": kind.value, "model_id": model_id,
                                  "seq_id": seq_id, "sampling_session_id": sampling_session_id, "payload": payload,
                                  "payload_format": payload_format, "payload_sha": sha,
                                  "num_tokens": num_tokens, "order": _next_order(session)})
        session.commit()
    except IntegrityError:  # a concurrent retry won the race
        session.rollback()
        if not keyed:
            raise
        return _same_or_conflict(holder(session, model_id, seq_id), kind, sha, model_id, seq_id)
    return Queued(rid)


def refuse(session, *, tenant_id: str, kind: RequestKind, payload_sha: str, model_id: str, seq_id: int,
           error: str) -> None:
    """Settle a training request the API refused after its model and seq_id were known: store it as
    a failed row (no payload, the refusal as its error) and commit, so the model's later requests do
    not wait for it. Nothing if (model_id, seq_id) is taken meanwhile."""
    try:
        # The model's row lock (PostgreSQL; SQLite's writes are serial anyway): a worker finishing
        # seq_id - 1 at this moment either sees this row committed or has committed before we look.
        session.execute(_LOCK_MODEL, {"mid": model_id})
        session.execute(_INSERT, {"id": uuid.uuid4().hex, "tenant_id": tenant_id, "kind": kind.value,
                                  "model_id": model_id, "seq_id": seq_id, "payload": b"", "payload_sha": payload_sha,
                                  "state": _FAILED, "error": error, "error_category": "user", "finished_at": now(),
                                  "order": _next_order(session)})
        _pass_refused(session, model_id)
        session.commit()
    except IntegrityError:  # a concurrent retry stored it first
        session.rollback()


def _pass_refused(session, model_id: str) -> None:
    while session.execute(_PASS_REFUSED, {"mid": model_id}).rowcount:
        pass


def _same_or_conflict(existing, kind: RequestKind, sha: str, model_id, seq_id) -> Queued:
    if existing.kind == kind.value and existing.payload_sha == sha:
        return Queued(existing.id)
    raise Conflict(f"model {model_id} already has a different request with seq_id {seq_id}")


def runnable(session, limit: int = 16) -> list:
    """Queued requests that may run now (id, order, model_id, seq_id, kind), in arrival order:
    each model's next seq_id, and sampling requests."""
    out = list(session.execute(_RUNNABLE_TRAINING, {"n": limit})) + list(session.execute(_RUNNABLE_SAMPLING,
                                                                                           {"n": limit}))
    return sorted(out, key=lambda r: r.order)[:limit]


def claim(session, req, worker_id: str) -> Claimed | None:
    """Atomically move a queued request to running for this worker, and commit; None if someone
    else did."""
    row = session.execute(_CLAIM, {"rid": req.id, "worker": worker_id, "at": now()}).first()
    session.commit()
    return Claimed(**row._asdict()) if row is not None else None


def claim_next(session, worker_id: str) -> Claimed | None:
    """The first runnable request this worker wins, or None when nothing is runnable."""
    for candidate in runnable(session):
        won = claim(session, candidate, worker_id)
        if won is not None:
            return won
    return None


def heads(session, per_tenant: int = 64) -> list:
    """Queued requests that may run now, with what packing needs (id, tenant (its name), kind,
    num_tokens, order, model_id (None for sampling), base (its base model's name; "" if the store
    lost its sampling session)), in arrival order: each model's next seq_id, and sampling requests;
    at most `per_tenant` of each tenant (its oldest), so a tenant with thousands queued neither
    hides the others nor makes this read grow with its backlog."""
    return list(session.execute(_HEADS, {"per_tenant": per_tenant}))


def claim_batch(session, ids, worker_id: str) -> list[Claimed]:
    """Atomically move the still-queued requests among `ids` to running for this worker, and
    commit: those it won, in the order of `ids` (another executor may have taken some)."""
    if not ids:
        return []
    rows = {r.id: r for r in session.execute(_CLAIM_BATCH, {"rids": list(ids), "worker": worker_id, "at": now()})}
    session.commit()
    return [Claimed(**rows[i]._asdict()) for i in ids if i in rows]


def finish(session, req_id: str, worker_id: str, *, result: bytes | None = None, result_format: str = "json",
           error: str | None = None, category: str = "user") -> bool:
    """Write a result (or an error) and, for a training request, advance its model's done_seq, in
    one transaction with whatever the session already holds. False (and rolled back) if the request
    is no longer this worker's: it was requeued."""
    failed = error is not None
    at = now()
    row = session.execute(_FINISH, {"rid": req_id, "worker": worker_id,
                                    "st": (RequestState.FAILED if failed else RequestState.DONE).value,
                                    "res": result, "fmt": result_format, "err": error,
                                    "cat": category if failed else None, "at": at}).first()
    if row is None:
        session.rollback()
        return False
    if row.seq_id is not None and row.model_id is not None and row.kind != RequestKind.SAMPLE.value:
        session.execute(_ADVANCE, {"mid": row.model_id, "seq": row.seq_id, "at": at})
        _pass_refused(session, row.model_id)
    session.commit()
    return True


MAX_ATTEMPTS = 3
"""Default: executors a request may take down (each death requeues it) before it is failed."""


def requeue_abandoned(session, worker_id: str | None = None, max_attempts: int = MAX_ATTEMPTS) -> int:
    """Running requests of a dead worker (or of any worker, at start-up) go back to the queue;
    the worker restores model state first, so nothing is applied twice (see executor.ensure_model)."""
    return _requeue(session, max_attempts, *(() if worker_id is None else (Request.claimed_by == worker_id,)))


def requeue_expired(session, lease_s: float, max_attempts: int = MAX_ATTEMPTS) -> int:
    """Running requests whose claimant has not renewed its lease (its endpoint's last_seen) for
    `lease_s` seconds go back to the queue: it died mid-request after the start-up requeue."""
    live = select(Endpoint.id).where(Endpoint.role == "worker",
                                     Endpoint.last_seen >= now() - dt.timedelta(seconds=lease_s))
    return _requeue(session, max_attempts, Request.claimed_by.not_in(live))


def _requeue(session, max_attempts: int, *where) -> int:
    """Requeue, except a request already claimed `max_attempts` times: it has taken down every
    executor that ran it, and requeued it would take down the next one and stop its model's
    queue; it fails (and its model's later requests run), like any failed request."""
    running = (Request.state == RequestState.RUNNING.value, *where)
    at = now()
    doomed = session.execute(
        update(Request).where(*running, Request.attempts >= max_attempts)
        .values(state=RequestState.FAILED.value, error_category="server", finished_at=at,
                error=f"the executor died {max_attempts} times while running this request; it is failed so "
                      f"that the requests after it can run")
        .returning(Request.model_id, Request.seq_id, Request.kind)).all()
    for row in doomed:
        if row.seq_id is not None and row.model_id is not None and row.kind != RequestKind.SAMPLE.value:
            session.execute(_ADVANCE, {"mid": row.model_id, "seq": row.seq_id, "at": at})
    res = session.execute(update(Request).where(*running)
                          .values(state=RequestState.QUEUED.value, claimed_by=None, claimed_at=None))
    session.commit()
    return res.rowcount
