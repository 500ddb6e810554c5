"""The service's health as one record of numbers, from the store, for its alert rules
(monitor/service_alerts.toml): the error rate of recent requests, the queue, retried jobs, workers."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, select

from lockstep.service.db import Endpoint, Job, now
from lockstep.service.db import Request as RequestRow
from lockstep.service.types import WORKER_LEASE_S, JobState, RequestState

ERROR_WINDOW_S = 300.0


def live_workers(s) -> int:
    """Workers holding a current lease (as /v1/health counts them)."""
    return s.scalar(select(func.count()).select_from(Endpoint).where(
        Endpoint.role == "worker", Endpoint.last_seen >= now() - dt.timedelta(seconds=WORKER_LEASE_S))) or 0


def busy_workers(s) -> int:
    """Workers running a request now."""
    return s.scalar(select(func.count(func.distinct(RequestRow.claimed_by)))
                    .where(RequestRow.state == RequestState.RUNNING.value)) or 0


def service_record(sessions) -> dict:
    at = now()
    with sessions() as s:
        recent = dict(s.execute(select(RequestRow.state, func.count()).where(
            RequestRow.finished_at >= at - dt.timedelta(seconds=ERROR_WINDOW_S),
            RequestRow.state.in_((RequestState.DONE.value, RequestState.FAILED.value))).group_by(RequestRow.state)).all())
        finished = sum(recent.values())
        live_jobs = [st.value for st in JobState if not st.terminal]
        return {
            "requests/error_rate": recent.get(RequestState.FAILED.value, 0) / finished if finished else 0.0,
            "requests/finished_last_5m": finished,
            "requests/queued": s.scalar(select(func.count()).select_from(RequestRow)
                                        .where(RequestRow.state == RequestState.QUEUED.value)),
            "jobs/max_attempts": s.scalar(select(func.coalesce(func.max(Job.attempts), 0))
                                          .where(Job.state.in_(live_jobs))),
            "jobs/failed_last_hour": s.scalar(select(func.count()).select_from(Job).where(
                Job.state == JobState.FAILED.value, Job.finished_at >= at - dt.timedelta(hours=1))),
            "workers/live": live_workers(s),
        }
