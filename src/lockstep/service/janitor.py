"""The janitor: deletes what has expired, run by the worker's supervisor every `janitor_every_s`.

- A checkpoint past its `expires_at` (a save's `ttl_seconds`): its row goes first (its tinker://
  path is then a 404 like any unknown one), then its storage.
- Sampling sessions of a session that is finished or has not sent a heartbeat for
  `session_ttl_s`: their rows, then their pinned weights (an ephemeral snapshot, or a named save's
  copy nothing else points at any more).
- Worker and API endpoints not seen for an hour (their doorbell addresses).

Storage is deleted only once no row points at it (`delete_unreferenced`), after the commit that
removed the last row, so a crash in between leaks storage at worst and never loses what is in use.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from sqlalchemy import delete, or_, select

from lockstep.service.db import Checkpoint, Endpoint, Model, SamplingSession, Session, StabilityRecord, now
from lockstep.service.storage import Storage

log = logging.getLogger("lockstep.janitor")
ENDPOINT_TTL_S = 3600.0


@dataclass(frozen=True)
class Swept:
    checkpoints: int
    samplers: int
    endpoints: int


def delete_unreferenced(sessions, storage: Storage, key: str) -> bool:
    """Delete a stored state unless a row points at it (a model's durable state, a checkpoint, a
    sampler's pinned weights); True if it was deleted."""
    with sessions() as s:
        for column in (Model.state_path, Checkpoint.storage_path, SamplingSession.weights_path):
            if s.scalar(select(column).where(column == key).limit(1)) is not None:
                return False
    storage.delete(key)
    return True


def sweep(sessions, storage: Storage, *, session_ttl_s: float) -> Swept:
    at = now()
    with sessions() as s:
        expired = list(s.scalars(select(Checkpoint).where(Checkpoint.expires_at <= at)))
        stale = select(Session.id).where(or_(Session.finished_at.is_not(None),
                                             Session.last_heartbeat < at - dt.timedelta(seconds=session_ttl_s)))
        samplers = list(s.scalars(select(SamplingSession).where(SamplingSession.session_id.in_(stale))))
        keys = {c.storage_path for c in expired} | {x.weights_path for x in samplers if x.weights_path}
        for row in (*expired, *samplers):
            s.delete(row)
        gone = s.execute(delete(Endpoint).where(Endpoint.last_seen < at - dt.timedelta(seconds=ENDPOINT_TTL_S)))
        s.execute(delete(StabilityRecord).where(StabilityRecord.expires_at <= at))  # their day is over
        s.commit()
    for key in sorted(keys):
        delete_unreferenced(sessions, storage, key)
    swept = Swept(len(expired), len(samplers), gone.rowcount)
    if expired or samplers:
        log.info("deleted %d expired checkpoints and %d sampling sessions of ended sessions",
                 swept.checkpoints, swept.samplers)
    return swept
