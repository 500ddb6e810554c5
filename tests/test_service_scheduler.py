"""The scheduler's launch (STARTING until the job's process exists, off the tick), cancels and
worker stops during it, and its metrics tail, against the API app and a Ray of the test's own
that offers one job slot (which a test can hold itself, so a launch waits for it as long as the
test needs: no timing)."""

import concurrent.futures
import json
import os
import subprocess
import sys
import time

import pytest
import ray
from sqlalchemy import select

from lockstep import memlimit, raylocal
from lockstep.service.db import Job, JobEvent
from lockstep.service.jobstate import move
from lockstep.service.launch import SLOT, Attempt, LaunchCancelled, MetricsTail
from lockstep.service.scheduler import PREEMPTED_EXIT, Scheduler
from lockstep.service.types import JobState
from test_service_policy import call, queued_job, states, submit, svc  # noqa: F401 - svc is a fixture


@pytest.fixture(scope="module")
def slot():
    """A local Ray with one job slot; the test holds it (a placement group) until it lets go."""
    from ray.util.placement_group import placement_group, remove_placement_group

    raylocal.init("", num_cpus=1, resources={SLOT: 1})

    class Hold:
        def take(self):
            self.pg = placement_group([{SLOT: 1}])
            ray.get(self.pg.ready())

        def release(self):
            remove_placement_group(self.pg)

    yield Hold()
    ray.shutdown()


def scheduler(svc) -> Scheduler:
    return Scheduler(svc.sessions, svc.storage, svc.tmp / "worker", "", policy=svc.policy,
                     memory=memlimit.detect("rlimit"))


def live_groups() -> list:
    return [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


def starting(svc, sched, slot) -> str:
    """A job the scheduler claimed and is launching: STARTING, its launch waiting for the held slot."""
    slot.take()
    job_id = queued_job(svc)
    sched.tick()
    assert job_id in sched.starting and call(svc, "alice", "GET", f"jobs/{job_id}").json()["state"] == "starting"
    return job_id


def settle(sched) -> None:
    """Wait for every launch in flight to finish (an event, not a delay), then record them."""
    concurrent.futures.wait([launch.future for launch in sched.starting.values()])
    sched.tick()


def test_a_cancel_while_starting_gives_the_slot_back_and_starts_nothing(svc, slot):
    sched = scheduler(svc)
    job_id = starting(svc, sched, slot)
    assert call(svc, "alice", "POST", f"jobs/{job_id}/cancel").json()["state"] == "cancelling"
    sched.tick()  # asks the launch to stop
    future = sched.starting[job_id].future
    concurrent.futures.wait([future])
    assert isinstance(future.exception(), LaunchCancelled)
    sched.tick()
    assert states(svc, job_id) == ["queued", "starting", "cancelling", "cancelled"]
    assert sched.starting == {} and sched.running == {}
    assert len(live_groups()) == 1  # the test's own: the launch gave its slot back
    assert not (svc.tmp / "worker" / "jobs" / job_id / "attempt-1.log").exists()  # no process was started
    slot.release()


def test_a_process_that_started_as_the_cancel_came_is_stopped_and_never_shown_running(svc, slot):
    """The tenant cancels while the launch is past its last look at the flag: the process starts,
    the job never shows RUNNING, and the scheduler stops the process like any other."""
    sched = scheduler(svc)
    job_id = starting(svc, sched, slot)
    assert call(svc, "alice", "POST", f"jobs/{job_id}/cancel").json()["state"] == "cancelling"
    slot.release()  # before the scheduler's next tick: the launch takes the slot and starts the process
    settle(sched)  # the launch is recorded, the job stays CANCELLING, and its process gets SIGTERM
    attempt = sched.running[job_id]
    assert attempt.signalled_at is not None
    attempt.proc.wait()
    sched.tick()
    assert states(svc, job_id) == ["queued", "starting", "cancelling", "cancelled"]
    assert sched.running == {} and live_groups() == []
    assert (svc.tmp / "worker" / "jobs" / job_id / "attempt-1.log").exists()


def test_a_worker_stopping_while_a_job_starts_requeues_it_with_its_attempt_given_back(svc, slot):
    sched = scheduler(svc)
    job_id = starting(svc, sched, slot)
    sched.shutdown()
    job = call(svc, "alice", "GET", f"jobs/{job_id}").json()
    assert (job["state"], job["attempts"], job["interruptions"]) == ("queued", 0, 1), job
    assert states(svc, job_id) == ["queued", "starting", "queued"]
    assert len(live_groups()) == 1
    slot.release()


# -- the metrics tail ----------------------------------------------------------------------------------
def record(step: int, t: float) -> bytes:
    return json.dumps({"step": step, "time": t, "train/loss_sum": 1.0 / step}).encode() + b"\n"


def test_the_metrics_tail_leaves_a_torn_line_for_later_and_sends_no_record_twice(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(record(1, 1.0) + record(2, 2.0))
    tail = MetricsTail(path)  # an earlier attempt's records: already sent
    assert tail.new() == []
    line = record(3, 3.0)
    with open(path, "ab") as f:
        f.write(line[:10])  # a write in progress: no newline yet
    assert tail.new() == []
    with open(path, "ab") as f:
        f.write(line[10:])
    assert [r["step"] for r in tail.new()] == [3]
    # A resumed run keeps the records through its checkpoint (step 2) and replaces the file.
    tmp = tmp_path / "metrics.jsonl.tmp"
    tmp.write_bytes(record(1, 1.0) + record(2, 2.0) + record(3, 9.0) + record(4, 10.0) + record(5, 11.0))
    os.replace(tmp, path)  # longer than before: only the inode shows the rewrite
    assert [(r["step"], r["time"]) for r in tail.new()] == [(3, 9.0), (4, 10.0), (5, 11.0)]
    assert tail.new() == []


def test_a_torn_metrics_line_never_fails_a_tick(svc, slot):
    """A running attempt's metrics.jsonl ends in a partial line (the run is writing it): the tick
    records the complete lines, and the rest once it is complete, each once."""
    sched = scheduler(svc)
    job_id = queued_job(svc)
    with svc.sessions() as s:
        for to in ("starting", "running"):
            assert move(s, s.get(Job, job_id), JobState(to))
        s.commit()
    run_dir = svc.tmp / "worker" / "jobs" / job_id / "run"
    run_dir.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    limit = memlimit.JobMemory(memlimit.detect("rlimit"), job_id, 1 << 30)
    sched.running[job_id] = Attempt(job_id, "", 1, proc, run_dir.parent, None, limit, started=time.time(),
                                    budget_s=1e9, tail=MetricsTail(run_dir / "metrics.jsonl"))
    try:
        (run_dir / "metrics.jsonl").write_bytes(record(1, 1.0) + record(2, 2.0)[:7])
        sched.tick()
        with open(run_dir / "metrics.jsonl", "ab") as f:
            f.write(record(2, 2.0)[7:])
        sched.tick()
        sched.tick()
        with svc.sessions() as s:
            steps = [e.data["step"] for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id,
                                                                              JobEvent.kind == "metrics"))]
        assert steps == [1, 2]
    finally:
        proc.kill()
        proc.wait()


def test_an_attempt_a_preemption_or_a_worker_stop_ends_is_given_back(svc):
    """A running job with max_attempts = 1 whose attempt a reserved job's preemption, or its
    worker's stop, ends (exit 75 after checkpointing) goes back to the queue with attempts 0 and
    the right counter: its resumed attempt is attempt 1 again, never 2 of 1."""
    for stopping, counter in ((False, "preemptions"), (True, "interruptions")):
        job_id = submit(svc, "alice", {}, max_attempts=1).json()["id"]
        with svc.sessions() as s:
            job = s.get(Job, job_id)
            for to in ("starting", "running", "preempting"):
                assert move(s, job, JobState(to), **({"attempts": 1} if to == "starting" else {}))
            s.commit()
            sched = scheduler(svc)
            sched.stopping = stopping
            sched._end_attempt(s, job, 1, time.time(), PREEMPTED_EXIT, None)
            s.commit()
        got = call(svc, "alice", "GET", f"jobs/{job_id}").json()
        assert (got["state"], got["attempts"], got[counter]) == ("queued", 0, 1), got
        assert got["preemptions"] + got["interruptions"] == 1
