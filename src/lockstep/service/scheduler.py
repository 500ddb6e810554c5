"""The job scheduler: runs declarative RL jobs (`lockstep run` on a RunSpec) within capacity.

Capacity is a Ray resource, `lockstep_job_slots`, which the worker's Ray node offers; a running
job holds one slot through a placement group for its whole attempt. Jobs start in priority order
(reserved first, then by submission), at most `max_concurrent_jobs` running per tenant. When a
reserved job waits and no slot is free, the newest running preemptible job is preempted: it gets
SIGTERM, checkpoints at its next step boundary and exits with PREEMPTED_EXIT; it then goes back to
the queue and later resumes from its checkpoint (`lockstep run --resume`). A failed attempt is
retried with exponential backoff, resuming from its last checkpoint, up to `max_attempts`.

Each attempt is a `lockstep run` process joining the worker's Ray cluster; its metrics.jsonl is
tailed into the store (job_events) for the live stream, and its artifacts are uploaded to storage
when it succeeds.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
from sqlalchemy import select

from lockstep.service.db import Job, JobEvent, Tenant, Usage, now
from lockstep.service.storage import Storage
from lockstep.service.types import JOB_TRANSITIONS, JobState, Priority, UsageKind

log = logging.getLogger("lockstep.scheduler")

SLOT = "lockstep_job_slots"
PREEMPTED_EXIT = 75
"""`lockstep run` exits with this after checkpointing on SIGTERM (EX_TEMPFAIL)."""
BACKOFF_S = 5.0
"""First retry delay; doubles per failed attempt."""
KILL_GRACE_S = 60.0
"""How long a job may take to checkpoint after SIGTERM before it is killed."""
ARTIFACTS = ("report.html", "summary.json", "metrics.jsonl", "config.json")


def move(job: Job, to: JobState) -> None:
    now_state = JobState(job.state)
    if to not in JOB_TRANSITIONS[now_state]:
        raise RuntimeError(f"job {job.id}: {now_state.value} -> {to.value} is not a valid transition")
    job.state = to.value


@dataclass
class Attempt:
    job_id: str
    proc: subprocess.Popen
    run_dir: Path
    pg: object
    started: float
    metrics_offset: int = 0
    signalled_at: float | None = None
    log_path: Path = field(default=None)


class Scheduler:
    def __init__(self, sessions, storage: Storage, home: Path, ray_address: str):
        self.sessions, self.storage, self.home, self.ray_address = sessions, storage, Path(home), ray_address
        self.running: dict[str, Attempt] = {}

    def capacity(self) -> int:
        return int(ray.cluster_resources().get(SLOT, 0))

    # -- one scheduling pass ---------------------------------------------------------------------
    def tick(self) -> None:
        for attempt in list(self.running.values()):
            self._poll(attempt)
        with self.sessions() as s:
            self._cancel_requested(s)
            self._start_queued(s)

    def _cancel_requested(self, s) -> None:
        for job in s.scalars(select(Job).where(Job.state == JobState.CANCELLING.value)):
            attempt = self.running.get(job.id)
            if attempt is None:
                move(job, JobState.CANCELLED)
                job.finished_at = now()
                self._event(s, job, "state", {"state": job.state})
            elif attempt.signalled_at is None:
                self._signal(attempt)
        s.commit()

    def _waiting(self, s) -> list[Job]:
        jobs = list(s.scalars(select(Job).where(Job.state == JobState.QUEUED.value, Job.next_attempt_at <= now())))
        return sorted(jobs, key=lambda j: (j.priority != Priority.RESERVED.value, j.created_at))

    def _start_queued(self, s) -> None:
        free = self.capacity() - len(self.running)
        per_tenant: dict[str, int] = {}
        for job in s.scalars(select(Job).where(Job.state.in_([JobState.RUNNING.value, JobState.PREEMPTING.value]))):
            per_tenant[job.tenant_id] = per_tenant.get(job.tenant_id, 0) + 1
        for job in self._waiting(s):
            tenant = s.get(Tenant, job.tenant_id)
            if per_tenant.get(job.tenant_id, 0) >= tenant.max_concurrent_jobs:
                continue
            if free <= 0:
                if job.priority == Priority.RESERVED.value:
                    self._preempt_for(s, job)
                break
            self._start(s, job)
            free -= 1
            per_tenant[job.tenant_id] = per_tenant.get(job.tenant_id, 0) + 1
        s.commit()

    def _preempt_for(self, s, job: Job) -> None:
        if any(JobState(s.get(Job, jid).state) is JobState.PREEMPTING for jid in self.running):
            return  # one preemption at a time: the slot it frees goes to this job next tick
        victims = [s.get(Job, jid) for jid in self.running]
        victims = [v for v in victims if v.priority == Priority.PREEMPTIBLE.value and v.state == JobState.RUNNING.value]
        if not victims:
            return
        victim = max(victims, key=lambda v: v.started_at or now())
        log.info("preempting job %s for reserved job %s", victim.id, job.id)
        move(victim, JobState.PREEMPTING)
        self._event(s, victim, "state", {"state": victim.state, "for": job.id})
        self._signal(self.running[victim.id])

    # -- attempts --------------------------------------------------------------------------------
    def run_dir(self, job_id: str) -> Path:
        return self.home / "jobs" / job_id

    def _start(self, s, job: Job) -> None:
        from ray.util.placement_group import placement_group

        pg = placement_group([{SLOT: 1}])
        ray.get(pg.ready(), timeout=60)
        d = self.run_dir(job.id)
        d.mkdir(parents=True, exist_ok=True)
        spec = d / "spec.json"
        share = max(1, int(ray.cluster_resources().get("CPU", 1)) // max(1, self.capacity()))
        spec.write_text(json.dumps({**job.spec, "runtime": {**job.spec.get("runtime", {}), "cpus": share}}))
        run = d / "run"
        resume = (run / "ledger.jsonl").exists()
        cmd = [sys.executable, "-m", "lockstep.cli", "run"]
        cmd += ["--resume", str(run)] if resume else [str(spec), "--run-dir", str(run)]
        if self.ray_address:
            cmd += ["--ray-address", self.ray_address]
        log_path = d / f"attempt-{job.attempts + 1}.log"
        proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        move(job, JobState.RUNNING)
        job.attempts += 1
        job.started_at = job.started_at or now()
        self._event(s, job, "state", {"state": job.state, "attempt": job.attempts, "resumed": resume})
        offset = sum(1 for _ in open(run / "metrics.jsonl")) if resume and (run / "metrics.jsonl").exists() else 0
        self.running[job.id] = Attempt(job.id, proc, run, pg, time.time(), offset, log_path=log_path)

    def _signal(self, attempt: Attempt) -> None:
        attempt.signalled_at = time.time()
        try:
            os.killpg(attempt.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def _tail(self, s, attempt: Attempt, job: Job) -> None:
        path = attempt.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        lines = path.read_text().splitlines()
        for line in lines[attempt.metrics_offset:]:
            if line.strip():
                self._event(s, job, "metrics", json.loads(line))
        attempt.metrics_offset = len(lines)

    def _poll(self, attempt: Attempt) -> None:
        code = attempt.proc.poll()
        with self.sessions() as s:
            job = s.get(Job, attempt.job_id)
            self._tail(s, attempt, job)
            if code is None:
                if attempt.signalled_at and time.time() - attempt.signalled_at > KILL_GRACE_S:
                    os.killpg(attempt.proc.pid, signal.SIGKILL)
                s.commit()
                return
            self._ended(s, job, attempt, code)
            s.commit()

    def _ended(self, s, job: Job, attempt: Attempt, code: int) -> None:
        from ray.util.placement_group import remove_placement_group

        del self.running[job.id]
        remove_placement_group(attempt.pg)
        s.add(Usage(tenant_id=job.tenant_id, kind=UsageKind.COMPUTE_SECONDS.value,
                    amount=time.time() - attempt.started, source=job.id))
        state = JobState(job.state)
        if code == 0:
            self._succeeded(s, job, attempt)
        elif state is JobState.CANCELLING:
            move(job, JobState.CANCELLED)
            job.finished_at = now()
        elif code == PREEMPTED_EXIT and state is JobState.PREEMPTING:
            move(job, JobState.QUEUED)
            job.preemptions += 1
        else:
            tail = attempt.log_path.read_text()[-2000:] if attempt.log_path.exists() else ""
            job.error = f"attempt {job.attempts} exited with code {code}:\n{tail}"
            if state is JobState.PREEMPTING:
                move(job, JobState.QUEUED)
            elif job.attempts < job.max_attempts:
                move(job, JobState.QUEUED)
                job.next_attempt_at = now() + dt.timedelta(seconds=BACKOFF_S * 2 ** (job.attempts - 1))
            else:
                move(job, JobState.FAILED)
                job.finished_at = now()
        self._event(s, job, "state", {"state": job.state, "exit_code": code})

    def _succeeded(self, s, job: Job, attempt: Attempt) -> None:
        summary = json.loads((attempt.run_dir / "summary.json").read_text())
        for name in ARTIFACTS:
            if (attempt.run_dir / name).exists():
                self.storage.put_file(attempt.run_dir / name, f"jobs/{job.tenant_id}/{job.id}/{name}")
        if (attempt.run_dir / "final_model").is_dir():
            self.storage.put_dir(attempt.run_dir / "final_model", f"jobs/{job.tenant_id}/{job.id}/final_model")
        counters = summary.get("counters", {})
        for kind, key in ((UsageKind.TOKENS_TRAINED, "tokens/trained"), (UsageKind.TOKENS_SAMPLED, "tokens/sampled")):
            if counters.get(key):
                s.add(Usage(tenant_id=job.tenant_id, kind=kind.value, amount=float(counters[key]), source=job.id))
        move(job, JobState.SUCCEEDED)
        job.summary = {k: v for k, v in summary.items() if k not in ("evals", "stages")}
        job.finished_at = now()

    def _event(self, s, job: Job, kind: str, data: dict) -> None:
        s.add(JobEvent(job_id=job.id, kind=kind, data=data))

    def shutdown(self) -> None:
        """The worker stops: running jobs are preempted (they resume when a worker is back)."""
        for attempt in list(self.running.values()):
            self._signal(attempt)
        deadline = time.time() + KILL_GRACE_S
        while self.running and time.time() < deadline:
            for attempt in list(self.running.values()):
                if attempt.proc.poll() is not None:
                    with self.sessions() as s:
                        job = s.get(Job, attempt.job_id)
                        if job.state == JobState.RUNNING.value:
                            move(job, JobState.PREEMPTING)
                        self._ended(s, job, attempt, attempt.proc.returncode)
                        s.commit()
            time.sleep(0.2)


def adopt_orphans(sessions) -> int:
    """At worker start-up: jobs a dead worker was running go back to the queue (they resume)."""
    with sessions() as s:
        jobs = list(s.scalars(select(Job).where(Job.state.in_([JobState.RUNNING.value, JobState.PREEMPTING.value]))))
        for job in jobs:
            job.state = JobState.QUEUED.value
            s.add(JobEvent(job_id=job.id, kind="state", data={"state": job.state, "reason": "worker restarted"}))
        cancelling = list(s.scalars(select(Job).where(Job.state == JobState.CANCELLING.value)))
        for job in cancelling:
            job.state, job.finished_at = JobState.CANCELLED.value, now()
        s.commit()
    return len(jobs)

