"""The job scheduler: runs declarative RL jobs (`lockstep run` on a RunSpec) within capacity.

Capacity is a Ray resource, `lockstep_job_slots`, which the worker's Ray node offers; a running
job holds one slot through a placement group for its whole attempt. Jobs start in priority order
(reserved first, then by submission), at most `max_concurrent_jobs` running per tenant. When a
reserved job waits and no slot is free, the newest running preemptible job is preempted: it gets
SIGTERM, checkpoints at its next step boundary and exits with PREEMPTED_EXIT; it then goes back to
the queue and later resumes from its checkpoint (`lockstep run --resume`). A failed attempt is
retried with exponential backoff, resuming from its last checkpoint, up to `max_attempts`.

Before each attempt the stored spec is checked again against the worker's own policy (a row
written behind the API's back gets no further), and its references are resolved server-side:
datasets and a `job:<id>` model are copied into the job's directory, a base model's name becomes
its directory. The job's running time is capped (`max_wall_seconds`, over all attempts).

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

import datetime as dt
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from sqlalchemy import select

from lockstep.config import to_dict
from lockstep.envs.registry import ALLOWLIST_ENV
from lockstep.service.db import Job, Tenant, Usage, now
from lockstep.service.jobstate import move
from lockstep.service.policy import Inputs, Limits, Policy, check_spec, data_fields, from_env, resolve
from lockstep.service.storage import Storage
from lockstep.service.types import JobState, Priority, ServiceError, UsageKind

__all__ = ["Scheduler", "adopt_orphans", "move", "SLOT", "PREEMPTED_EXIT", "SUPERVISOR_ENV"]

log = logging.getLogger("lockstep.scheduler")

SLOT = "lockstep_job_slots"
PREEMPTED_EXIT = 75
"""`lockstep run` exits with this after checkpointing on SIGTERM (EX_TEMPFAIL)."""
SUPERVISOR_ENV = "LOCKSTEP_SUPERVISOR_PID"
"""Set on a job process: the pid whose death ends it (see cli.py's watchdog)."""
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
ARTIFACTS = ("report.html", "summary.json", "metrics.jsonl", "config.json")


@dataclass
class Attempt:
    job_id: str
    tenant_id: str
    number: int
    proc: subprocess.Popen
    job_dir: Path
    pg: object
    started: float
    budget_s: float
    """Running time left to the job under max_wall_seconds when this attempt started."""
    metrics_offset: int = 0
    signalled_at: float | None = None
    log_uploaded: float = 0.0
    stopped_for: str | None = None
    """Why the scheduler killed it (over its time cap): the job then fails with this message."""

    @property
    def run_dir(self) -> Path:
        return self.job_dir / "run"

    @property
    def log_path(self) -> Path:
        return self.job_dir / f"attempt-{self.number}.log"


class Scheduler:
    def __init__(self, sessions, storage: Storage, home: Path, ray_address: str, policy: Policy | None = None):
        self.sessions, self.storage, self.home, self.ray_address = sessions, storage, Path(home), ray_address
        self.policy = policy if policy is not None else from_env()
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
                move(s, job, JobState.CANCELLED, finished_at=now())
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
        """Check the stored spec, claim the job (QUEUED -> RUNNING, a compare-and-set: a job
        cancelled meanwhile is not started) and launch its attempt. True if it started."""
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
        job_dir = self.home / "jobs" / job.id
        resume = (job_dir / "run" / "ledger.jsonl").exists()
        number = job.attempts + 1
        if not move(s, job, JobState.RUNNING, event={"attempt": number, "resumed": resume}, attempts=number,
                    started_at=job.started_at or now()):
            return False
        s.commit()  # claimed: from here a cancel sees RUNNING and the attempt is asked to stop
        try:
            self.running[job.id] = self._launch(job, d, inputs, limits, job_dir, number, budget, resume)
        except Exception as e:  # noqa: BLE001 - the attempt fails, never the scheduler
            message = str(e) if isinstance(e, ServiceError) else "the worker could not start it (see its log)"
            log.exception("job %s: attempt %d did not start", job.id, number)
            self._end_attempt(s, job, number, time.time(), code=None, error=f"attempt {number}: {message}",
                              fatal=isinstance(e, ServiceError))
            s.commit()
            return False
        return True

    def _launch(self, job: Job, d: dict, inputs: Inputs, limits: Limits, job_dir: Path, number: int, budget: float,
                resume: bool) -> Attempt:
        from ray.util.placement_group import placement_group, remove_placement_group

        pg = placement_group([{SLOT: 1}])
        try:
            ray.get(pg.ready(), timeout=60)
            job_dir.mkdir(parents=True, exist_ok=True)
            spec = self._materialise(d, inputs, job_dir, limits.max_job_gpus)
            run = job_dir / "run"
            cmd = [sys.executable, "-m", "lockstep.cli", "run"]
            cmd += ["--resume", str(run)] if resume else [str(spec), "--run-dir", str(run)]
            if self.ray_address:
                cmd += ["--ray-address", self.ray_address]
            env = {**os.environ, "PYTHONWARNINGS": "ignore", SUPERVISOR_ENV: str(os.getpid()),
                   ALLOWLIST_ENV: ",".join(limits.user_env_modules)}
            with open(job_dir / f"attempt-{number}.log", "w") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        except BaseException:
            remove_placement_group(pg)
            raise
        offset = sum(1 for _ in open(run / "metrics.jsonl")) if resume and (run / "metrics.jsonl").exists() else 0
        return Attempt(job.id, job.tenant_id, number, proc, job_dir, pg, time.time(), budget, offset)

    def _materialise(self, d: dict, inputs: Inputs, job_dir: Path, max_gpus: int = 0) -> Path:
        """spec.json for `lockstep run`: references replaced by local paths, inputs copied into
        the job's directory (kept for the resumed attempts); a CUDA job gets the GPUs it asked for
        (check_spec capped them) or, asking for the machine's (-1), the tenant's cap."""
        d = json.loads(json.dumps(d))
        local = job_dir / "inputs"
        local.mkdir(exist_ok=True)
        if inputs.model_kind == "base":
            d["model"]["path"] = inputs.model
        elif inputs.model_kind == "job":
            target = local / "model"
            if not target.is_dir():
                if not self.storage.has_dir(inputs.model):
                    raise ServiceError(f"model.path {d['model']['path']!r}: that job's final model is not in storage")
                self.storage.get_dir(inputs.model, job_dir / ".model-partial")
                (job_dir / ".model-partial").rename(target)
            d["model"]["path"] = str(target)
        for field, value in data_fields(d):
            if value:
                key = inputs.datasets[value]
                target = local / key.rsplit("/", 1)[1]  # "<id>.<format>": the suite reads the suffix
                if not target.is_file():
                    if not self.storage.exists(key):
                        raise ServiceError(f"{field}: dataset {value} is not in storage (deleted?)")
                    with self.storage.open(key) as src, open(target.with_suffix(".partial"), "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    target.with_suffix(".partial").rename(target)
                _set(d, field, str(target))
        share = max(1, int(ray.cluster_resources().get("CPU", 1)) // max(1, self.capacity()))
        d["runtime"]["cpus"] = share
        if d["model"]["device"] == "cuda" and d["runtime"]["gpus"] < 0:
            d["runtime"]["gpus"] = max_gpus
        spec = job_dir / "spec.json"
        spec.write_text(json.dumps(d))
        return spec

    def _signal(self, attempt: Attempt) -> None:
        attempt.signalled_at = time.time()
        _killpg(attempt.proc.pid, signal.SIGTERM)

    def _tail(self, s, attempt: Attempt, job: Job) -> None:
        from lockstep.service.db import JobEvent

        path = attempt.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        lines = path.read_text().splitlines()
        for line in lines[attempt.metrics_offset:]:
            if line.strip():
                s.add(JobEvent(job_id=job.id, kind="metrics", data=json.loads(line)))
        attempt.metrics_offset = len(lines)

    def _poll(self, attempt: Attempt) -> None:
        code = attempt.proc.poll()
        with self.sessions() as s:
            job = s.get(Job, attempt.job_id)
            self._tail(s, attempt, job)
            if code is None:
                if time.time() - attempt.log_uploaded > LOG_EVERY_S:
                    self._upload_log(attempt)
                ran = job.run_seconds + time.time() - attempt.started
                if attempt.stopped_for is None and time.time() - attempt.started > attempt.budget_s:
                    attempt.stopped_for = over_time(ran, self.policy.for_tenant(s.get(Tenant, job.tenant_id).name))
                    log.warning("job %s: %s", job.id, attempt.stopped_for)
                    _killpg(attempt.proc.pid, signal.SIGKILL)
                elif attempt.signalled_at and time.time() - attempt.signalled_at > KILL_GRACE_S:
                    _killpg(attempt.proc.pid, signal.SIGKILL)
                s.commit()
                return
            self._ended(s, job, attempt, code)
            s.commit()

    def _ended(self, s, job: Job, attempt: Attempt, code: int) -> None:
        from ray.util.placement_group import remove_placement_group

        del self.running[job.id]
        remove_placement_group(attempt.pg)
        self._upload_log(attempt)
        error, summary = None, None
        if attempt.stopped_for:
            error = attempt.stopped_for
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
        self._end_attempt(s, job, attempt.number, attempt.started, code, error, fatal=attempt.stopped_for is not None,
                          summary=summary)

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

    @staticmethod
    def _outcome(job: Job, state: JobState, number: int, code: int | None, error: str | None, fatal: bool,
                 summary: dict | None) -> tuple[JobState, dict]:
        done = {"finished_at": now()}
        if fatal:
            return JobState.FAILED, {**done, "error": error}
        if code == 0:
            return JobState.SUCCEEDED, {**done, "summary": summary}
        if state is JobState.CANCELLING:
            return JobState.CANCELLED, done
        if code == PREEMPTED_EXIT and state is JobState.PREEMPTING:
            return JobState.QUEUED, {"preemptions": job.preemptions + 1}
        if state is JobState.PREEMPTING:
            return JobState.QUEUED, {"error": error}
        if number < job.max_attempts:
            return JobState.QUEUED, {"error": error, "next_attempt_at": now() + dt.timedelta(
                seconds=BACKOFF_S * 2 ** (number - 1))}
        return JobState.FAILED, {**done, "error": error}

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
                            move(s, job, JobState.PREEMPTING, event={"reason": "worker stopping"})
                        self._ended(s, job, attempt, attempt.proc.returncode)
                        s.commit()
            time.sleep(0.2)


def adopt_orphans(sessions) -> int:
    """At worker start-up: jobs a dead worker was running go back to the queue (they resume);
    those being cancelled end cancelled."""
    with sessions() as s:
        jobs = list(s.scalars(select(Job).where(Job.state.in_([JobState.RUNNING.value, JobState.PREEMPTING.value]))))
        adopted = sum(move(s, job, JobState.QUEUED, event={"reason": "worker restarted"}) for job in jobs)
        for job in s.scalars(select(Job).where(Job.state == JobState.CANCELLING.value)):
            move(s, job, JobState.CANCELLED, event={"reason": "worker restarted"}, finished_at=now())
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


def _set(d: dict, field: str, value) -> None:
    """d[field] = value for a data_fields() name ("env.path", "stages[1].dataset")."""
    head, key = field.split(".")
    node = d["stages"][int(head[7:-1])] if head.startswith("stages[") else d[head]
    node[key] = value


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
