"""The job scheduler: runs declarative RL jobs (`lockstep run` on a RunSpec) within capacity.

Capacity is a Ray resource, `lockstep_job_slots`, which the worker's Ray node offers; a job holds
one slot through a placement group from its start to the end of its attempt. Jobs start in
priority order (reserved first, then by submission), at most `max_concurrent_jobs` at once per
tenant. When a reserved job waits and no slot is free, the newest running preemptible job is
preempted: it gets SIGTERM, checkpoints at its next step boundary and exits with PREEMPTED_EXIT;
it then goes back to the queue and later resumes from its checkpoint (`lockstep run --resume`). A
failed attempt is retried with exponential backoff, resuming from its last checkpoint, up to
`max_attempts`; an attempt that a preemption or its worker's stop or death interrupted is not a
failure: it gives its attempt back (`attempts` never exceeds `max_attempts`) and is counted in
`preemptions` or `interruptions`.

A job is STARTING from its claim until its process exists, then RUNNING: the slot wait, the
input copies and the process start run on a thread (launch.py), never on the tick, and a cancel
meanwhile stops the launch and gives the slot back. The job's running time is capped from its
process's start (`max_wall_seconds`, over all attempts), its memory by its own cgroup or an
rlimit (`max_job_memory_mb`, lockstep/memlimit.py).

Before each attempt the stored spec is checked again against the worker's own policy (a row
written behind the API's back gets no further), and its references are resolved server-side:
datasets and a `job:<id>` model are copied into the job's directory, a base model's name becomes
its directory.

Every state change goes through `move` (jobstate.py), a compare-and-set on the old state: the API
may cancel a job between the scheduler reading it and acting on it, and then the scheduler's move
fails and it acts on what the job is now.

Each attempt is a `lockstep run` process joining the worker's Ray cluster, in its own process
group, which ends itself when the worker (its parent) dies ($LOCKSTEP_SUPERVISOR_PID, see
cli.py); its metrics.jsonl is tailed into the store (job_events) for the live stream, its output
is uploaded to storage every few seconds for `GET /v1/jobs/ID/logs`, and its artifacts are
uploaded when it succeeds.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import json
import logging
import os
import re
import signal
import time
from pathlib import Path

import ray
from sqlalchemy import select

from lockstep import memlimit
from lockstep.config import to_dict
from lockstep.service.db import Job, JobEvent, Tenant, Usage, now
from lockstep.service.jobstate import move
from lockstep.service.launch import SLOT, SUPERVISOR_ENV, Attempt, Launch, LaunchCancelled, Plan, launch
from lockstep.service.policy import Limits, Policy, check_spec, from_env, resolve
from lockstep.service.storage import Storage
from lockstep.service.types import JobState, Priority, ServiceError, UsageKind

__all__ = ["Scheduler", "adopt_orphans", "move", "SLOT", "PREEMPTED_EXIT", "SUPERVISOR_ENV"]

log = logging.getLogger("lockstep.scheduler")

PREEMPTED_EXIT = 75
"""`lockstep run` exits with this after checkpointing on SIGTERM (EX_TEMPFAIL)."""
BACKOFF_S = 5.0
"""First retry delay; doubles per failed attempt."""
KILL_GRACE_S = 60.0
"""How long a job may take to checkpoint after SIGTERM before it is killed."""
LOG_EVERY_S = 5.0
"""How often a running attempt's output is uploaded for the logs endpoint."""
LOG_TAIL_BYTES = 1 << 20
"""The end of an attempt's output that is kept in storage."""
ENV_LOG_TAIL_BYTES = 64 << 10
"""The end of the run's envs.log appended to it."""
MAX_INTERRUPTIONS = 10
"""A job its worker's stop or death interrupted this often is failed rather than requeued again
(interruptions give their attempt back, so nothing else would end a job that kills its worker)."""
ARTIFACTS = ("report.html", "summary.json", "metrics.jsonl", "config.json")
LIVE = (JobState.STARTING.value, JobState.RUNNING.value, JobState.PREEMPTING.value)
"""States in which a job holds (or is taking) a slot."""


class Scheduler:
    def __init__(self, sessions, storage: Storage, home: Path, ray_address: str, policy: Policy | None = None,
                 memory: memlimit.Backend | None = None):
        self.sessions, self.storage, self.home, self.ray_address = sessions, storage, Path(home), ray_address
        self.policy = policy if policy is not None else from_env()
        self.memory = memory if memory is not None else memlimit.detect()
        self.running: dict[str, Attempt] = {}
        self.starting: dict[str, Launch] = {}
        self.stopping = False
        """The worker is stopping: the attempts that end now were interrupted, not preempted."""
        self._leftovers: list[memlimit.JobMemory] = []
        """Ended attempts' cgroups still busy (a killed process not yet reaped): removed later."""
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="job-launch")

    def capacity(self) -> int:
        return int(ray.cluster_resources().get(SLOT, 0))

    # -- one scheduling pass ---------------------------------------------------------------------
    def tick(self) -> None:
        for attempt in list(self.running.values()):
            self._poll(attempt)
        with self.sessions() as s:
            self._launched(s)
            self._cancel_requested(s)
            self._start_queued(s)
        self._leftovers = [m for m in self._leftovers if not m.remove()]

    def _cancel_requested(self, s) -> None:
        for job in s.scalars(select(Job).where(Job.state == JobState.CANCELLING.value)):
            attempt, starting = self.running.get(job.id), self.starting.get(job.id)
            if attempt is not None:
                if attempt.signalled_at is None:
                    self._signal(attempt)
            elif starting is not None:
                starting.cancel.set()  # _launched cancels the job once the launch has let go
            else:
                move(s, job, JobState.CANCELLED, finished_at=now())
        s.commit()

    def _waiting(self, s) -> list[Job]:
        jobs = list(s.scalars(select(Job).where(Job.state == JobState.QUEUED.value, Job.next_attempt_at <= now())))
        return sorted(jobs, key=lambda j: (j.priority != Priority.RESERVED.value, j.created_at))

    def _start_queued(self, s) -> None:
        free = self.capacity() - len(self.running) - len(self.starting)
        per_tenant: dict[str, int] = {}
        for job in s.scalars(select(Job).where(Job.state.in_(LIVE))):
            per_tenant[job.tenant_id] = per_tenant.get(job.tenant_id, 0) + 1
        for job in self._waiting(s):
            tenant = s.get(Tenant, job.tenant_id)
            if tenant is None:  # deleted behind the API's back: this job fails, the others go on
                self._refuse(s, job, f"its tenant {job.tenant_id!r} no longer exists")
                continue
            if per_tenant.get(job.tenant_id, 0) >= tenant.max_concurrent_jobs:
                continue
            if free <= 0:
                if job.priority == Priority.RESERVED.value:
                    self._preempt_for(s, job)
                break
            if self._start(s, job, tenant):
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
        if move(s, victim, JobState.PREEMPTING, event={"for": job.id}):
            s.commit()
            self._signal(self.running[victim.id])

    # -- attempts --------------------------------------------------------------------------------
    def run_dir(self, job_id: str) -> Path:
        return self.home / "jobs" / job_id / "run"

    def _refuse(self, s, job: Job, message: str) -> None:
        log.warning("job %s refused at start: %s", job.id, message)
        if move(s, job, JobState.FAILED, event={"reason": "refused"}, error=message, finished_at=now()):
            s.commit()

    def _start(self, s, job: Job, tenant: Tenant) -> bool:
        """Check the stored spec, claim the job (QUEUED -> STARTING, a compare-and-set: a job
        cancelled meanwhile is not started) and launch its attempt on a thread. True if claimed."""
        limits = self.policy.for_tenant(tenant.name)
        try:
            d = to_dict(check_spec(job.spec, limits))
            inputs = resolve(s, job.tenant_id, d)
        except ServiceError as e:
            self._refuse(s, job, f"refused by the worker's policy: {e}")
            return False
        budget = limits.max_wall_seconds - job.run_seconds
        if budget <= 0:
            self._refuse(s, job, over_time(job.run_seconds, limits))
            return False
        if job.attempts >= job.max_attempts:  # only a row written behind the API's back gets here
            self._refuse(s, job, f"it has used all of its max_attempts = {job.max_attempts} attempts")
            return False
        job_dir = self.home / "jobs" / job.id
        resume = (job_dir / "run" / "ledger.jsonl").exists()
        number = job.attempts + 1
        if not move(s, job, JobState.STARTING, event={"attempt": number, "resumed": resume}, attempts=number):
            return False
        s.commit()  # claimed: from here a cancel sees STARTING and the launch is asked to stop
        plan = Plan(job.id, job.tenant_id, number, d, inputs, limits, job_dir, budget, resume)
        started = Launch(plan, None)
        started.future = self._pool.submit(launch, plan, started.cancel, storage=self.storage,
                                           ray_address=self.ray_address, memory=self.memory, capacity=self.capacity())
        self.starting[job.id] = started
        return True

    def _launched(self, s) -> None:
        """Record the launches that finished: RUNNING once the process exists (unless a cancel
        came: then the process is stopped like any other), the job cancelled or the attempt
        failed if none was started."""
        for job_id, started in list(self.starting.items()):
            if not started.future.done():
                continue
            del self.starting[job_id]
            job, number = s.get(Job, job_id), started.plan.number
            try:
                attempt = started.future.result()
            except LaunchCancelled:
                self._not_started(s, job, number, None)
            except Exception as e:  # noqa: BLE001 - the attempt fails, never the scheduler
                log.error("job %s: attempt %d did not start", job_id, number, exc_info=e)
                self._not_started(s, job, number, e)
            else:
                self.running[job_id] = attempt
                if job.state == JobState.STARTING.value:  # (a cancel meanwhile: _cancel_requested stops it)
                    move(s, job, JobState.RUNNING, event={"attempt": number}, started_at=job.started_at or now())
            s.commit()

    def _not_started(self, s, job: Job, number: int, error: Exception | None) -> None:
        if self.stopping:
            self._requeue_interrupted(s, job, "worker stopping")
            return
        if error is None:
            message = "its start was cancelled"
        elif isinstance(error, ServiceError):
            message = str(error)
        else:
            message = "the worker could not start it (see its log)"
        self._end_attempt(s, job, number, time.time(), code=None, error=f"attempt {number}: {message}",
                          fatal=isinstance(error, ServiceError))

    def _signal(self, attempt: Attempt) -> None:
        attempt.signalled_at = time.time()
        _killpg(attempt.proc.pid, signal.SIGTERM)

    def _tail(self, s, attempt: Attempt, job: Job) -> None:
        for record in attempt.tail.new():
            s.add(JobEvent(job_id=job.id, kind="metrics", data=record))

    def _poll(self, attempt: Attempt) -> None:
        code = attempt.proc.poll()
        with self.sessions() as s:
            job = s.get(Job, attempt.job_id)
            self._tail(s, attempt, job)
            if code is None:
                if time.time() - attempt.log_uploaded > LOG_EVERY_S:
                    self._upload_log(attempt)
                self._enforce_caps(s, job, attempt)
                s.commit()
                return
            self._ended(s, job, attempt, code)
            s.commit()

    def _enforce_caps(self, s, job: Job, attempt: Attempt) -> None:
        """Stop a live attempt over its time cap, its memory cap (the kernel killed one of its
        processes for it) or its grace after SIGTERM."""
        if attempt.stopped_for is None:
            if time.time() - attempt.started > attempt.budget_s:
                ran = job.run_seconds + time.time() - attempt.started
                attempt.stopped_for = over_time(ran, self.policy.for_tenant(s.get(Tenant, job.tenant_id).name))
            elif attempt.memory.oom_kills():
                attempt.stopped_for = f"attempt {attempt.number}: stopped: {attempt.memory.describe('max_job_memory_mb')}"
            if attempt.stopped_for is not None:
                log.warning("job %s: %s", job.id, attempt.stopped_for)
                self._kill(attempt)
        elif attempt.signalled_at and time.time() - attempt.signalled_at > KILL_GRACE_S:
            self._kill(attempt)

    def _kill(self, attempt: Attempt) -> None:
        _killpg(attempt.proc.pid, signal.SIGKILL)
        attempt.memory.kill()  # its Ray actors too: they are the raylet's children, in the job's cgroup

    def _ended(self, s, job: Job, attempt: Attempt, code: int) -> None:
        from ray.util.placement_group import remove_placement_group

        del self.running[job.id]
        remove_placement_group(attempt.pg)
        self._upload_log(attempt)
        over_memory = attempt.stopped_for is None and code != 0 and self._over_memory(attempt)
        if (peak := attempt.memory.peak()) is not None:
            log.info("job %s attempt %d: peak memory %d MiB (cap %d MiB)", job.id, attempt.number, peak >> 20,
                     attempt.memory.limit >> 20)
        if not attempt.memory.remove():
            self._leftovers.append(attempt.memory)
        error, summary = None, None
        if attempt.stopped_for:
            error = attempt.stopped_for
        elif over_memory:
            error = f"attempt {attempt.number} ran out of memory: {attempt.memory.describe('max_job_memory_mb')}"
        elif code == 0:
            try:
                summary = self._store_results(s, job, attempt)
            except Exception:  # noqa: BLE001 - a storage failure fails the attempt, not the worker
                log.exception("job %s: storing its results failed", job.id)
                code, error = -1, f"attempt {attempt.number}: its results could not be stored (the worker logged why)"
        elif code != PREEMPTED_EXIT:
            tail = _read_tail(attempt.log_path)
            log.warning("job %s attempt %d exited with code %s; its output ends:\n%s", job.id, attempt.number, code,
                        tail[-4000:])
            error = f"attempt {attempt.number} exited with code {code}: {attempt_error(tail, attempt.job_dir)}"
        fatal = attempt.stopped_for is not None or over_memory
        self._end_attempt(s, job, attempt.number, attempt.started, code, error, fatal=fatal, summary=summary)

    @staticmethod
    def _over_memory(attempt: Attempt) -> bool:
        """Whether a failed attempt died of its memory limit: an OOM kill in its cgroup, or (under
        RLIMIT_AS) an allocation refused in its output."""
        if attempt.memory.cgroup is not None:
            return attempt.memory.oom_kills() > 0
        return memlimit.ran_out(_read_tail(attempt.log_path, 64 << 10))

    def _end_attempt(self, s, job: Job, number: int, started: float, code: int | None, error: str | None, *,
                     fatal: bool = False, summary: dict | None = None) -> None:
        """Move the job on after an attempt, from the state it is in now (a cancel may have come)."""
        elapsed = time.time() - started
        s.add(Usage(tenant_id=job.tenant_id, kind=UsageKind.COMPUTE_SECONDS.value, amount=elapsed, source=job.id))
        for _ in range(10):  # each lost race is a state change by the API; a handful at most
            to, values = self._outcome(job, JobState(job.state), number, code, error, fatal, summary)
            if move(s, job, to, event={"exit_code": code}, run_seconds=job.run_seconds + elapsed, **values):
                return
        raise RuntimeError(f"job {job.id}: could not record the end of attempt {number}")

    def _outcome(self, job: Job, state: JobState, number: int, code: int | None, error: str | None, fatal: bool,
                 summary: dict | None) -> tuple[JobState, dict]:
        done = {"finished_at": now()}
        if fatal:
            return JobState.FAILED, {**done, "error": error}
        if code == 0:
            return JobState.SUCCEEDED, {**done, "summary": summary}
        if state is JobState.CANCELLING:
            return JobState.CANCELLED, done
        if state is JobState.PREEMPTING:  # given back: a preemption or the worker's stop is no failure
            counter = "interruptions" if self.stopping else "preemptions"
            values = {counter: getattr(job, counter) + 1, "attempts": max(0, job.attempts - 1)}
            return JobState.QUEUED, values if code == PREEMPTED_EXIT else {**values, "error": error}
        if number < job.max_attempts:
            return JobState.QUEUED, {"error": error, "next_attempt_at": now() + dt.timedelta(
                seconds=BACKOFF_S * 2 ** (number - 1))}
        return JobState.FAILED, {**done, "error": error}

    def _requeue_interrupted(self, s, job: Job, reason: str) -> None:
        """A job whose attempt its worker's stop interrupted before it ran: back to the queue, its
        attempt given back."""
        for _ in range(10):
            state = JobState(job.state)
            if state is JobState.CANCELLING:
                if move(s, job, JobState.CANCELLED, event={"reason": reason}, finished_at=now()):
                    return
            elif move(s, job, JobState.QUEUED, event={"reason": reason}, **_interrupted(job)):
                return

    def _store_results(self, s, job: Job, attempt: Attempt) -> dict:
        """Upload the artifacts and meter the tokens; -> the summary the job shows."""
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
        return {k: v for k, v in summary.items() if k not in ("evals", "stages")}

    def _upload_log(self, attempt: Attempt) -> None:
        """The end of the attempt's output, then of its envs' failures (envs.log), with the job's
        directory shown relative to it."""
        attempt.log_uploaded = time.time()
        try:
            text = redact(_read_tail(attempt.log_path), attempt.job_dir)
            envs = _read_tail(attempt.run_dir / "envs.log", ENV_LOG_TAIL_BYTES)
            if envs:
                text += "\n--- envs.log: env failures (tracebacks, rate-limited) ---\n" + redact(envs, attempt.job_dir)
            out = attempt.job_dir / f"attempt-{attempt.number}.upload"
            out.write_text(text)
            self.storage.put_file(out, f"jobs/{attempt.tenant_id}/{attempt.job_id}/logs/attempt-{attempt.number}.log")
        except Exception as e:  # noqa: BLE001 - logs are best effort; the next upload retries
            log.warning("job %s: uploading its log failed: %s", attempt.job_id, e)

    def shutdown(self) -> None:
        """The worker stops: launches are called off and running jobs preempted; both go back to
        the queue, their attempts given back (they resume when a worker is back)."""
        self.stopping = True
        for started in self.starting.values():
            started.cancel.set()
        concurrent.futures.wait([started.future for started in self.starting.values()], timeout=KILL_GRACE_S)
        with self.sessions() as s:
            self._launched(s)  # (a process that started anyway joins the running ones)
            for attempt in self.running.values():
                job = s.get(Job, attempt.job_id)
                if job.state == JobState.RUNNING.value:
                    move(s, job, JobState.PREEMPTING, event={"reason": "worker stopping"})
                self._signal(attempt)
            s.commit()
        deadline = time.time() + KILL_GRACE_S
        while self.running and time.time() < deadline:
            for attempt in list(self.running.values()):
                if attempt.proc.poll() is not None:
                    with self.sessions() as s:
                        self._ended(s, s.get(Job, attempt.job_id), attempt, attempt.proc.returncode)
                        s.commit()
            time.sleep(0.2)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _interrupted(job: Job) -> dict:
    """The columns of a job whose attempt was interrupted by its worker: the attempt given back,
    the interruption counted."""
    return {"interruptions": job.interruptions + 1, "attempts": max(0, job.attempts - 1)}


def adopt_orphans(sessions) -> int:
    """At worker start-up: jobs a dead worker was starting or running go back to the queue (they
    resume; their attempt is given back, the interruption counted, up to MAX_INTERRUPTIONS);
    those being cancelled end cancelled."""
    reason = {"reason": "worker restarted"}
    with sessions() as s:
        adopted = 0
        for job in list(s.scalars(select(Job).where(Job.state.in_(LIVE)))):
            if job.interruptions + 1 > MAX_INTERRUPTIONS:
                move(s, job, JobState.FAILED, event=reason, finished_at=now(),
                     error=f"its worker stopped or died during {job.interruptions + 1} of its attempts "
                           f"(at most {MAX_INTERRUPTIONS}); not retried")
            else:
                adopted += move(s, job, JobState.QUEUED, event=reason, **_interrupted(job))
        for job in s.scalars(select(Job).where(Job.state == JobState.CANCELLING.value)):
            move(s, job, JobState.CANCELLED, event=reason, finished_at=now())
        s.commit()
    return adopted


# -- helpers -------------------------------------------------------------------------------------
def over_time(ran: float, limits: Limits) -> str:
    return (f"stopped after {ran:.0f} s of running time: over this server's cap max_wall_seconds = "
            f"{limits.max_wall_seconds:.0f}")


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _read_tail(path: Path, size: int = LOG_TAIL_BYTES) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - size))
        return f.read().decode("utf-8", "replace")


def redact(text: str, job_dir: Path) -> str:
    """The job's own directory as a relative path (the worker's layout is not the tenant's business)."""
    return text.replace(str(job_dir.resolve()) + "/", "").replace(str(job_dir) + "/", "")


_ABS_PATH = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)+([\w.+-]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def attempt_error(output: str, job_dir: Path, limit: int = 1000) -> str:
    """What a user needs from a failed attempt's output: `lockstep run`'s own `error: ...` line,
    else the exception that ended it (a traceback's last line), else its last line; the job's
    directory relative and other server paths cut to their file names."""
    lines = [ln.rstrip() for ln in _ANSI.sub("", redact(output, job_dir)).splitlines() if ln.strip()]
    message = next((ln[len("error: "):] for ln in reversed(lines) if ln.startswith("error: ")), None)
    if message is None:
        start = max((i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")),
                    default=None)
        if start is not None:
            rest = [ln for ln in lines[start + 1:] if not ln.startswith(" ")]
            message = rest[0] if rest else None
    message = message or (lines[-1] if lines else "no output")
    message = _ABS_PATH.sub(lambda m: m.group(1), message)
    return message[:limit]
