"""The request queue in the store: submit (idempotent on (model_id, seq_id)), claim, finish.

The API submits and long-polls; workers claim and finish. Training requests of a model run strictly
in seq_id order: a worker only claims seq_id == done_seq + 1, so chunks that arrive out of order
(the SDK posts the first chunk of a batch last) wait for their turn. Sampling requests carry no
seq_id and are claimed in arrival order.
"""

from __future__ import annotations

import hashlib
import uuid

from sqlalchemy import and_, select, update
from sqlalchemy.exc import IntegrityError

from lockstep.service.db import Counter, Model, Request, now
from lockstep.service.types import Conflict, RequestKind, RequestState

TRAINING_KINDS = tuple(k.value for k in RequestKind if k is not RequestKind.SAMPLE)


def _next_order(session) -> int:
    counter = session.get(Counter, "requests", with_for_update=True)
    if counter is None:
        counter = Counter(name="requests", value=0)
        session.add(counter)
    counter.value += 1
    return counter.value


def submit(session, *, tenant_id: str, kind: RequestKind, payload: bytes, payload_format: str = "json",
           model_id: str | None = None, seq_id: int | None = None, sampling_session_id: str | None = None,
           request_id: str | None = None) -> Request:
    """Queue a request; a retry of the same (model_id, seq_id) with the same payload returns the
    original request, a different payload is a 409."""
    sha = hashlib.sha256(payload).hexdigest()
    if model_id is not None and seq_id is not None:
        existing = session.scalar(select(Request).where(Request.model_id == model_id, Request.seq_id == seq_id))
        if existing is not None:
            return _same_or_conflict(existing, kind, sha, model_id, seq_id)
    req = Request(id=request_id or uuid.uuid4().hex, tenant_id=tenant_id, kind=kind.value, model_id=model_id,
                  seq_id=seq_id, sampling_session_id=sampling_session_id, payload=payload,
                  payload_format=payload_format, payload_sha=sha, order=_next_order(session))
    session.add(req)
    try:
        session.commit()
    except IntegrityError:  # a concurrent retry won the race
        session.rollback()
        existing = session.scalar(select(Request).where(Request.model_id == model_id, Request.seq_id == seq_id))
        return _same_or_conflict(existing, kind, sha, model_id, seq_id)
    return req


def _same_or_conflict(existing: Request, kind: RequestKind, sha: str, model_id, seq_id) -> Request:
    if existing.kind == kind.value and existing.payload_sha == sha:
        return existing
    raise Conflict(f"model {model_id} already has a different request with seq_id {seq_id}")


def runnable(session, limit: int = 16) -> list[Request]:
    """Queued requests that may run now: each model's next seq_id, and sampling requests."""
    nxt = (select(Request).join(Model, Model.id == Request.model_id)
           .where(Request.state == RequestState.QUEUED.value, Request.kind.in_(TRAINING_KINDS),
                  Request.seq_id == Model.done_seq + 1)
           .order_by(Request.order).limit(limit))
    sampling = (select(Request).where(Request.state == RequestState.QUEUED.value,
                                      Request.kind == RequestKind.SAMPLE.value)
                .order_by(Request.order).limit(limit))
    out = list(session.scalars(nxt)) + list(session.scalars(sampling))
    return sorted(out, key=lambda r: r.order)[:limit]


def claim(session, req: Request, worker_id: str) -> bool:
    """Atomically move a queued request to running for this worker; False if someone else did."""
    res = session.execute(update(Request).where(and_(Request.id == req.id, Request.state == RequestState.QUEUED.value))
                          .values(state=RequestState.RUNNING.value, claimed_by=worker_id, claimed_at=now()))
    session.commit()
    return res.rowcount == 1


def finish(session, req_id: str, *, result: bytes | None = None, result_format: str = "json",
           error: str | None = None, category: str = "user") -> None:
    """Write a result (or an error) and, for a training request, advance its model's done_seq, in
    one transaction."""
    req = session.get(Request, req_id)
    req.state = (RequestState.FAILED if error is not None else RequestState.DONE).value
    req.result, req.result_format = result, result_format
    req.error, req.error_category = error, (category if error is not None else None)
    req.finished_at = now()
    if req.seq_id is not None and req.model_id is not None and req.kind != RequestKind.SAMPLE.value:
        model = session.get(Model, req.model_id)
        if model is not None:
            model.done_seq = max(model.done_seq, req.seq_id)
            model.last_request_time = now()
    session.commit()


def requeue_abandoned(session, worker_id: str | None = None) -> int:
    """Running requests of a dead worker (or of any worker, at start-up) go back to the queue;
    the worker restores model state first, so nothing is applied twice (see worker.recover)."""
    q = update(Request).where(Request.state == RequestState.RUNNING.value)
    if worker_id is not None:
        q = q.where(Request.claimed_by == worker_id)
    res = session.execute(q.values(state=RequestState.QUEUED.value, claimed_by=None, claimed_at=None))
    session.commit()
    return res.rowcount
