"""Job event streams (`GET /v1/jobs/ID/events`) are bounded: a tenant's streams beyond its cap and
the server's beyond the global cap are a 429 naming the cap, and other tenants are unaffected;
a closed stream gives its slot back; quiet streams carry keep-alive comments and end as idle after
the policy's time (the CLI reconnects); one notifier feeds every stream, and no event is lost or
reordered. The API runs under uvicorn in a thread; job events are written into the store directly,
as the worker's scheduler writes them from its own process."""

import contextlib
import json
import os
import subprocess
import sys
import threading
import uuid

import httpx
import psutil
import pytest

from lockstep.service.app import ServiceConfig, create_app
from lockstep.service.db import Job, JobEvent, Tenant, connect
from lockstep.service.jobstate import move
from lockstep.service.notifier import JobNotifier
from lockstep.service.policy import Policy, PolicyError
from lockstep.service.tenants import create_tenant
from lockstep.service.types import JobState
from test_service_metrics import serve_in_thread
from helpers import wait_until

POLICY = {"max_event_streams": 3, "max_event_streams_total": 5, "event_keepalive_s": 0.05, "event_poll_s": 0.05,
          "tenants": {"idler": {"event_stream_idle_s": 1}}}


class Service:
    def __init__(self, tmp_path, policy: dict):
        self.tmp = tmp_path / uuid.uuid4().hex[:8]
        self.tmp.mkdir()
        self.db = f"sqlite:///{self.tmp / 'db.sqlite'}"
        _, self.sessions = connect(self.db)
        with self.sessions() as s:
            self.keys = {name: create_tenant(s, name)[1] for name in ("alice", "bob", "carol", "idler")}
        cfg = ServiceConfig(db_url=self.db, storage_url=str(self.tmp / "storage"), policy=Policy.from_dict(policy))
        self.port, self.server = serve_in_thread(create_app(cfg))
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=60, limits=httpx.Limits(max_connections=50))
        self.streams = contextlib.ExitStack()

    def job(self, tenant: str) -> str:
        with self.sessions() as s:
            tenant_id = s.query(Tenant.id).filter(Tenant.name == tenant).scalar()
            job = Job(id=uuid.uuid4().hex[:16], tenant_id=tenant_id, spec={}, state=JobState.QUEUED.value)
            s.add(job)
            s.add(JobEvent(job_id=job.id, kind="state", data={"state": "queued"}))
            s.commit()
            return job.id

    def write(self, job_id: str, *steps: int) -> list[int]:
        """Metrics events, in one transaction, as the scheduler's tail writes them; their ids."""
        with self.sessions() as s:
            rows = [JobEvent(job_id=job_id, kind="metrics", data={"step": k}) for k in steps]
            s.add_all(rows)
            s.commit()
            return [r.id for r in rows]

    def end(self, job_id: str) -> None:
        with self.sessions() as s:
            job = s.get(Job, job_id)
            # as the scheduler moves a job: started, running, then done
            assert all(move(s, job, to) for to in (JobState.STARTING, JobState.RUNNING, JobState.SUCCEEDED))
            s.commit()

    def open(self, tenant: str, job_id: str, **params) -> httpx.Response:
        """A following stream, held open (until close_all) if the server accepted it."""
        r = self.streams.enter_context(self.client.stream(
            "GET", f"/v1/jobs/{job_id}/events", params={"follow": "true", **params},
            headers={"Authorization": f"Bearer {self.keys[tenant]}"}))
        if r.status_code != 200:
            r.read()
        return r

    def open_streams(self, tenant: str) -> int:
        r = self.client.get("/v1/usage", headers={"Authorization": f"Bearer {self.keys[tenant]}"})
        return r.json()["event_streams"]

    def stop(self) -> None:
        self.streams.close()
        self.client.close()
        self.server.should_exit = True


@pytest.fixture()
def svc(tmp_path):
    service = Service(tmp_path, POLICY)
    yield service
    service.stop()


def events(response: httpx.Response):
    """(kind, id, data) of each SSE event of a stream, and ("comment", None, text) of each comment."""
    kind = event_id = None
    for line in response.iter_lines():
        if line.startswith(":"):
            yield "comment", None, line
        elif line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            yield kind, event_id, json.loads(line[6:])
            kind = event_id = None


def test_a_tenants_stream_over_its_cap_is_a_429_and_other_tenants_are_unaffected(svc):
    alices, bobs = svc.job("alice"), svc.job("bob")
    assert [svc.open("alice", alices).status_code for _ in range(3)] == [200, 200, 200]
    over = svc.open("alice", alices)
    assert over.status_code == 429 and "max_event_streams = 3" in over.json()["error"], over.json()
    assert svc.open_streams("alice") == 3
    assert svc.open("bob", bobs).status_code == 200  # bob's own cap, untouched by alice's
    assert svc.open_streams("bob") == 1


def test_the_servers_streams_over_the_global_cap_are_a_429(svc):
    alices, bobs, carols = svc.job("alice"), svc.job("bob"), svc.job("carol")
    assert [svc.open("alice", alices).status_code for _ in range(3)] == [200] * 3
    assert [svc.open("bob", bobs).status_code for _ in range(2)] == [200] * 2
    over = svc.open("carol", carols)  # carol has none open, but the server has 5
    assert over.status_code == 429 and "max_event_streams_total = 5" in over.json()["error"], over.json()
    assert svc.open_streams("carol") == 0


def test_closed_streams_give_their_slots_back(svc):
    job = svc.job("alice")
    streams = [svc.open("alice", job) for _ in range(3)]
    assert svc.open("alice", job).status_code == 429
    for r in streams:  # the clients go away while their streams wait for events
        r.close()
    wait_until(lambda: svc.open_streams("alice") == 0, what="the server to release alice's closed streams")
    assert [svc.open("alice", job).status_code for _ in range(3)] == [200] * 3


def test_a_refused_or_unknown_stream_takes_no_slot(svc):
    job = svc.job("alice")
    for _ in range(5):
        assert svc.open("bob", job).status_code == 404  # alice's job: unknown to bob
    assert svc.open_streams("bob") == 0
    assert [svc.open("bob", svc.job("bob")).status_code for _ in range(3)] == [200] * 3


def test_quiet_streams_carry_keep_alives_and_events_still_arrive(svc):
    job = svc.job("alice")
    r = svc.open("alice", job)
    seen = events(r)
    assert next(seen)[0] == "state"
    assert next(seen) == ("comment", None, ": keep-alive")  # nothing new: the server says it is alive
    [event_id] = svc.write(job, 1)
    assert next(e for e in seen if e[0] != "comment") == ("metrics", event_id, {"step": 1})


def test_an_idle_stream_ends_as_idle_and_resumes_from_its_place(svc):
    job = svc.job("idler")
    r = svc.open("idler", job)
    got = list(events(r))  # ends by itself: no event for event_stream_idle_s = 1
    first = got[0][1]
    assert got[0][0] == "state" and any(kind == "comment" for kind, _, _ in got)
    assert got[-1] == ("idle", None, {"after": first, "idle_seconds": 1, "state": "queued"})
    wait_until(lambda: svc.open_streams("idler") == 0, what="the ended stream's slot")
    [later] = svc.write(job, 7)
    svc.end(job)
    resumed = [e for e in events(svc.open("idler", job, after=first)) if e[0] != "comment"]
    assert resumed[0] == ("metrics", later, {"step": 7})
    assert [kind for kind, _, _ in resumed] == ["metrics", "state", "state", "state", "end"]  # starting, running, succeeded


def test_events_arrive_in_order_and_none_is_lost_across_the_notifier(tmp_path):
    """Two streams on each of three jobs, and one joining the first job mid-way from an id; 80
    commits of 1-5 events over the jobs, then each job ends: every stream gets its job's events
    after its start, each once, in id order, then `end`."""
    svc = Service(tmp_path, {**POLICY, "max_event_streams_total": 100, "event_stream_idle_s": 60})  # (a lost
    # wake-up would end a stream as idle after 60 s, and fail here, rather than hang)
    try:
        _follow_while_writing(svc)
    finally:
        svc.stop()


def _follow_while_writing(svc: Service) -> None:
    tenants = ("alice", "bob", "carol")
    jobs = [svc.job(t) for t in tenants]
    received: dict[tuple[str, int], list] = {}

    def follow(i: int, copy: int, after: int = 0) -> None:
        r = svc.open(tenants[i], jobs[i], after=after)
        received[jobs[i], copy] = [e for e in events(r) if e[0] != "comment"] if r.status_code == 200 else r.status_code

    readers = [threading.Thread(target=follow, args=(i, c)) for i in range(3) for c in range(2)]
    for t in readers:
        t.start()
    wait_until(lambda: sum(svc.open_streams(t) for t in tenants) == 6, what="six streams open")
    written: dict[str, list[int]] = {j: [] for j in jobs}
    step = late_after = 0
    for k in range(80):
        job = jobs[k % 3]
        written[job] += svc.write(job, *range(step, step + 1 + k % 5))
        step += 1 + k % 5
        if k == 40:
            late_after = written[jobs[0]][-1]
            readers.append(threading.Thread(target=follow, args=(0, 2, late_after)))
            readers[-1].start()
    for job in jobs:
        svc.end(job)
    for t in readers:
        t.join()
    assert len(received) == 7
    for (job, copy), got in received.items():
        expected = [i for i in written[job] if i > late_after] if copy == 2 else written[job]
        assert [i for kind, i, _ in got if kind == "metrics"] == expected, (job, copy)
        assert [d["step"] for kind, _, d in got if kind == "metrics"] == sorted(d["step"] for kind, _, d in got
                                                                              if kind == "metrics")
        assert got[-1] == ("end", None, {"state": "succeeded"}), (job, copy)
    wait_until(lambda: sum(svc.open_streams(t) for t in tenants) == 0, what="every ended stream's slot")


def test_the_cli_follows_across_keep_alives_and_reconnects_after_idle(svc, tmp_path):
    """`lockstep logs -f` against a stream that goes idle (1 s for this tenant) before the job
    ends: it reconnects from its last event and prints the job's end."""
    job = svc.job("idler")
    svc.write(job, 1)
    env = {"LOCKSTEP_SERVER": svc.url, "LOCKSTEP_API_KEY": svc.keys["idler"], "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "logs", job, "-f", "--json"], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, **env})
    try:
        assert json.loads(proc.stdout.readline()) == {"state": "queued"}
        assert json.loads(proc.stdout.readline()) == {"step": 1}
        first = _connections(proc)
        wait_until(lambda: first and _connections(proc) and not (_connections(proc) & first),
                   what="the CLI to reconnect after the stream went idle", timeout=120)
        svc.write(job, 2)
        assert json.loads(proc.stdout.readline()) == {"step": 2}  # printed once, after the reconnect
        svc.end(job)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.splitlines()[-1] == "job ended: succeeded" and proc.returncode == 0, out


def _connections(proc) -> set:
    """The local ports of the process's established connections (a reconnect opens a new one)."""
    try:
        return {c.laddr.port for c in psutil.Process(proc.pid).net_connections("tcp") if c.status == "ESTABLISHED"}
    except psutil.NoSuchProcess:
        return set()


def test_the_notifier_wakes_a_job_whose_event_commits_after_a_later_id(tmp_path):
    """On PostgreSQL a transaction can commit an event after another that took a later id. Written
    here with explicit ids, in that order: the notifier still wakes the first event's job, once."""
    _, sessions = connect(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with sessions() as s:
        tenant, _ = create_tenant(s, "alice")
        s.add_all([Job(id=j, tenant_id=tenant.id, spec={}) for j in ("a" * 16, "b" * 16)])
        s.commit()
    notifier = JobNotifier(sessions, every_s=1)
    assert notifier.poll() == set()  # the newest id: none yet

    def commit(event_id: int, job_id: str) -> None:
        with sessions() as s:
            s.add(JobEvent(id=event_id, job_id=job_id, kind="metrics", data={}))
            s.commit()

    commit(2, "b" * 16)  # id 1 was taken by a transaction still open
    assert notifier.poll() == {"b" * 16}
    commit(1, "a" * 16)
    assert notifier.poll() == {"a" * 16}
    assert notifier.poll() == set()


def test_the_policy_sets_stream_caps_per_tenant_and_process_settings_only_at_the_top():
    policy = Policy.from_dict({"max_event_streams": 4, "tenants": {"big": {"max_event_streams": 64}}})
    assert policy.for_tenant("big").max_event_streams == 64 and policy.for_tenant("other").max_event_streams == 4
    for key in ("max_event_streams_total", "event_keepalive_s", "event_poll_s"):
        with pytest.raises(PolicyError, match=f"tenants.big.{key}: a setting of the whole API process"):
            Policy.from_dict({"tenants": {"big": {key: 5}}})
    with pytest.raises(PolicyError, match="max_event_streams: expected a number >= 1, got 0"):
        Policy.from_dict({"max_event_streams": 0})


def test_the_streams_of_one_job_share_one_store_read_per_event(tmp_path, monkeypatch):
    """Ten streams follow one job; each new event costs one read of the store for all of them (a
    read per stream would be ten, and the old poll per stream two a second each, events or not)."""
    from lockstep.service import jobs_api

    reads = []
    real = jobs_api._events
    monkeypatch.setattr(jobs_api, "_events", lambda *a: reads.append(a) or real(*a))
    svc = Service(tmp_path, {**POLICY, "max_event_streams": 10, "max_event_streams_total": 10})
    try:
        job = svc.job("alice")
        streams = [events(svc.open("alice", job)) for _ in range(10)]
        for k in range(6):
            [event_id] = svc.write(job, k)
            for seen in streams:  # every stream has it before the next one is written
                assert next(e for e in seen if e[0] == "metrics")[1] == event_id
            if k == 0:
                reads.clear()  # from here on, all ten wait together for each event
        assert 5 <= len(reads) <= 10, len(reads)
    finally:
        svc.stop()
