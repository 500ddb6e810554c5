"""The job state machine: every change of a job's state is a compare-and-set in the store.

`move` writes `UPDATE jobs SET state = :to, ... WHERE id = :id AND state = :old`, so of two writers
that read the same state (the API cancelling a queued job, the scheduler starting it) exactly one
wins; the loser sees False and the job's state as the winner left it. The API (cancel) and the
worker (scheduler, orphan adoption) both change states only through here. Ray- and torch-free.
"""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.orm.attributes import set_committed_value

from lockstep.service.db import Job, JobEvent
from lockstep.service.types import JOB_TRANSITIONS, JobState


def move(s, job: Job, to: JobState, *, event: dict | None = None, **values) -> bool:
    """Move `job` from the state it was read in to `to`, setting `values` (columns) with it, and
    record a state event, in `s`'s transaction (the caller commits). False, and `job` reloaded on
    its next access, when its state changed in the store since it was read."""
    old = JobState(job.state)
    if to not in JOB_TRANSITIONS[old]:
        raise RuntimeError(f"job {job.id}: {old.value} -> {to.value} is not a valid transition")
    stmt = (update(Job).where(Job.id == job.id, Job.state == old.value).values(state=to.value, **values)
            .execution_options(synchronize_session=False))
    if s.execute(stmt).rowcount != 1:
        s.expire(job)
        return False
    for key, value in {"state": to.value, **values}.items():
        set_committed_value(job, key, value)  # what the row now holds; nothing left to flush
    s.add(JobEvent(job_id=job.id, kind="state", data={"state": to.value, **(event or {})}))
    return True
