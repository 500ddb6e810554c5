"""The worker fails small, nothing outlives its parent, and kill -9 anywhere loses nothing.

Hostile rows are written straight into the store (bypassing the API's checks) to show that the
worker does not depend on them; processes are found and killed with psutil as an operator (or the
kernel's OOM killer) would."""

import datetime as dt
import hashlib
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import uuid
from contextlib import closing
from pathlib import Path

import httpx
import psutil
import pytest
import tinker
from tinker import types

from helpers import wait_until
from service_harness import alive
from test_service_sdk import executor_of, logprobs, make_server, reference_logprobs, sft_datum

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


# -- helpers -------------------------------------------------------------------------------------
def start_logged(srv, *extra, log: Path, worker: bool = True) -> subprocess.Popen:
    """`lockstep serve` (with its worker unless told otherwise), its output in `log`."""
    port = srv.url.rsplit(":", 1)[1]
    args = [sys.executable, "-m", "lockstep.cli", "serve", "--port", port, "--db", srv.db, "--storage", srv.storage,
            *(f"--model={m}" for m in srv.models), *extra, *(() if worker else ("--no-worker",))]
    proc = subprocess.Popen(args, env=srv.env, start_new_session=True, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    srv.procs.append(proc)
    wait_until(lambda: up(srv, worker), timeout=180, what="lockstep serve")
    return proc


def up(srv, worker: bool = True) -> bool:
    try:
        health = httpx.get(f"{srv.url}/v1/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    return health["status"] == "ok" and (not worker or health["workers"] >= 1)


def store(srv):
    return closing(sqlite3.connect(srv.db.removeprefix("sqlite:///"), timeout=30))


def insert_request(srv, *, kind: str, payload: bytes, tenant_id: str, model_id=None, seq_id=None,
                   sampling_session_id=None, fmt: str = "json", order=None) -> str:
    """A queued request written straight into the store, as a buggy or hostile writer could
    (sqlite3 enforces no foreign keys unless asked to)."""
    rid = uuid.uuid4().hex
    with store(srv) as con, con:
        if order is None:
            order = con.execute('select coalesce(max("order"), 0) + 1 from requests').fetchone()[0]
        con.execute('insert into requests (id, tenant_id, kind, model_id, seq_id, sampling_session_id, payload, '
                    'payload_format, payload_sha, state, attempts, created_at, "order") '
                    'values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)',
                    (rid, tenant_id, kind, model_id, seq_id, sampling_session_id, payload, fmt,
                     hashlib.sha256(payload).hexdigest(), "queued", 0, dt.datetime.utcnow().isoformat(sep=" "), order))
    return rid


def row_at(srv, model_id: str, seq_id: int) -> dict | None:
    with store(srv) as con:
        con.row_factory = sqlite3.Row
        row = con.execute("select * from requests where model_id = ? and seq_id = ?", (model_id, seq_id)).fetchone()
        return dict(row) if row is not None else None


def job_row(srv, job_id: str) -> dict:
    with store(srv) as con:
        con.row_factory = sqlite3.Row
        return dict(con.execute("select * from jobs where id = ?", (job_id,)).fetchone())


def worker_child(serve: subprocess.Popen, old: int | None = None, timeout: float = 120) -> psutil.Process:
    def find():
        for p in psutil.Process(serve.pid).children():
            try:
                if "worker" in p.cmdline() and p.pid != old:
                    return p
            except psutil.NoSuchProcess:
                pass
        return None

    return wait_until(find, timeout=timeout, what="the worker process")


def tree(pid: int) -> list:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def describe(procs, width: int | None = 80) -> list:
    """"pid command line" per process, the command line cut to `width` characters (None: whole)."""
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:width]}")
        except psutil.NoSuchProcess:
            pass
    return out


def listening(procs) -> list:
    """(pid, address) of every TCP listener and bound UDP socket of these processes."""
    pids = {p.pid for p in procs}
    return [(c.pid, c.laddr) for c in psutil.net_connections("inet")
            if c.pid in pids and (c.status == psutil.CONN_LISTEN or c.type == 2) and c.laddr]


def submit_job(srv, key: str, *overrides) -> str:
    env = {**srv.env, "LOCKSTEP_SERVER": srv.url, "LOCKSTEP_API_KEY": key}
    out = subprocess.run([sys.executable, "-m", "lockstep.cli", "submit", *overrides, "--json"], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["id"]


LONG_JOB = ["stages.0.steps=9000", "stages.0.batch_size=8", "stages.0.eval_every=9000", "env.num_heldout=8",
            "env.pass_k=0", "rl.steps=1"]
"""Minutes of SFT (the tests stop it long before), within the default policy's max_steps."""


def job_driver(worker: psutil.Process, timeout: float = 180) -> psutil.Process:
    """The worker's running job (`lockstep run --run-dir .../jobs/<id>/run`), once its trainer is up."""
    def find():
        procs = worker.children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in alive(procs))
        if "TrainerActor" not in names:
            return None
        return next((p for p in alive(procs) if "run" in p.cmdline() and "lockstep.cli" in p.cmdline()), None)

    return wait_until(find, timeout=timeout, what="a running job")


# -- one bad request, one bad tick -------------------------------------------------------------
@pytest.fixture
def logged(tmp_path):
    srv = make_server(tmp_path)
    srv.keys = {"gail": srv.key("gail")}
    srv.log = tmp_path / "serve.log"
    yield srv
    srv.stop()


def test_hostile_rows_fail_alone_and_the_worker_serves_on(logged, builtin_dir):
    """A save with ttl 10^12 (it crashed the whole worker, for every tenant, forever), a payload
    that is not JSON, results the store refuses (a forward_backward and an optim_step whose usage
    rows break a foreign key: both already applied in memory, the optim_step had written a new
    durable state), a row that breaks the claim loop, a job row that breaks the scheduler's tick and
    a job whose tenant is gone (it fails alone): each request fails alone with a message, the loops back off and go on, and the model ends
    exactly where its valid requests alone take it (rebuilt from the durable state its failed
    optim_step would have replaced: deleted before the commit, it would be lost)."""
    srv = logged
    serve = start_logged(srv, log=srv.log)
    worker, sc = worker_child(serve), tinker.ServiceClient(base_url=srv.url, api_key=srv.keys["gail"])
    executor = executor_of(worker)
    tc = sc.create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=5).result()
    tok = tc.get_tokenizer()
    data = [sft_datum(tok, f"{a}+{b}=", f"{a + b:02d}") for a in range(4) for b in range(4)]
    adam = types.AdamParams(learning_rate=1e-2)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(adam).result()
    with store(srv) as con, con:  # hold the model's queue while three requests are rewritten in the store
        con.execute("update models set done_seq = -100 where id = ?", (tc.model_id,))
    carriers = [tc.save_state("far", ttl_seconds=3600), tc.optim_step(adam), tc.forward_backward(data, "cross_entropy"),
                tc.optim_step(adam)]
    wait_until(lambda: row_at(srv, tc.model_id, 6), what="the SDK's requests to be queued")
    with store(srv) as con, con:
        con.execute("update requests set payload = ? where model_id = ? and seq_id = 3",
                    (json.dumps({"name": "far", "ttl_seconds": 10**12}).encode(), tc.model_id))
        con.execute("update requests set payload = ? where model_id = ? and seq_id = 4", (b"\xff{not json", tc.model_id))
        con.execute("update requests set tenant_id = 'no-such-tenant' where model_id = ? and seq_id in (5, 6)",
                    (tc.model_id,))
        con.execute("update models set done_seq = 2 where id = ?", (tc.model_id,))
    for f, message in zip(carriers, ("ttl_seconds must be", "not JSON")):
        with pytest.raises(Exception, match=message):
            f.result()
    rows = wait_until(lambda: (r := [row_at(srv, tc.model_id, seq) for seq in (3, 4, 5, 6)])[3]["state"]
                      in ("done", "failed") and r, what="the last request")  # (the last two are not ours any more)
    assert [r["state"] for r in rows] == ["failed"] * 4
    assert [r["error_category"] for r in rows] == ["user", "user", "server", "server"]
    assert "recording the result of forward_backward: IntegrityError" in rows[2]["error"]
    assert "recording the result of optim_step: IntegrityError" in rows[3]["error"]
    mark = len(srv.log.read_text())  # the loops' failures from here on
    # A row that makes every claim attempt raise, while a real request waits behind it.
    bad = insert_request(srv, kind="sample", tenant_id=rows[1]["tenant_id"], sampling_session_id="nowhere",
                         payload=b"{}", order="x")
    with store(srv) as con, con:  # a job whose tenant does not exist, and one the scheduler cannot even read
        stamp = dt.datetime.utcnow().isoformat(sep=" ")
        for job_id, created in (("ghost-job", stamp), ("garbled-job", "not a date")):
            con.execute("insert into jobs (id, tenant_id, name, spec, priority, state, attempts, max_attempts, "
                        "preemptions, next_attempt_at, created_at) values (?, 'nobody', '', '{}', 'reserved', 'queued', "
                        "0, 3, 0, ?, ?)", (job_id, stamp, created))
    waiting = tc.forward_backward(data, "cross_entropy")
    # Backing off, not spinning: each loop's own logged pause doubles from one failure to the next.
    claims = wait_until(lambda: len(p := re.findall(r"the claim loop failed; retrying in ([\d.]+) s",
                                                    srv.log.read_text()[mark:])) >= 3 and p, what="three claim failures")
    ticks = wait_until(lambda: len(p := re.findall(r"the scheduler tick failed; next try in (\d+) s",
                                                   srv.log.read_text()[mark:])) >= 3 and p, what="three tick failures")
    assert [float(x) for x in claims[:3]] == [0.5, 1.0, 2.0], claims
    assert [int(x) for x in ticks[:3]] == [1, 2, 4], ticks
    with store(srv) as con, con:
        con.execute("delete from requests where id = ?", (bad,))
        con.execute("delete from jobs where id = 'garbled-job'")
    # The ghost job fails alone, with a message (it used to break every tick, for every tenant).
    ghost = wait_until(lambda: (r := job_row(srv, "ghost-job"))["state"] == "failed" and r, what="the ghost job to fail")
    assert "tenant 'nobody' no longer exists" in ghost["error"]
    waiting.result()
    tc.optim_step(adam).result()
    got = logprobs(tc.forward(data, "cross_entropy").result())
    assert all(p.is_running() for p in (worker, executor)), "the worker or its executor was replaced"
    assert executor_of(worker).pid == executor.pid
    # Two valid steps; the failed optim_step and forward_backward changed nothing.
    assert all((a == b).all() for a, b in zip(got, reference_logprobs(builtin_dir, data, steps=2, lr=1e-2, seed=5)))


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_request_that_keeps_killing_the_executor_is_failed_and_its_model_goes_on(logged, builtin_dir):
    """SIGKILL the executor every time it holds one request: after --max-attempts 2 claims the
    request fails with a message instead of being requeued forever; the model's later requests
    run, on the state its earlier ones made (the killed request has no effect)."""
    srv = logged
    serve = start_logged(srv, "--max-attempts", "2", log=srv.log)
    worker, sc = worker_child(serve), tinker.ServiceClient(base_url=srv.url, api_key=srv.keys["gail"])
    tc = sc.create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=5).result()
    tok = tc.get_tokenizer()
    data = [sft_datum(tok, f"{a}+{b}=", f"{a + b:02d}") for a in range(4) for b in range(4)]
    heavy = [sft_datum(tok, "9" * 200 + f"+{a}=", "9" * 200) for a in range(48)]  # ~1 s, not milliseconds
    adam = types.AdamParams(learning_rate=1e-2)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(adam).result()
    doomed = tc.forward_backward(heavy, "cross_entropy")
    after = [tc.optim_step(adam), tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)]
    victim = None
    for attempt in (1, 2):  # the heavy forward_backward is the model's third request
        wait_until(lambda: (r := row_at(srv, tc.model_id, 3)) and r["state"] == "running" and r["attempts"] == attempt,
                   timeout=180, every=0.02, what=f"claim {attempt} of the heavy request")
        victim = executor_of(worker, old=victim and victim.pid)
        victim.kill()
    with pytest.raises(Exception, match="executor died 2 times while running this request"):
        doomed.result()
    for f in after:
        f.result()
    got = logprobs(tc.forward(data, "cross_entropy").result())
    assert row_at(srv, tc.model_id, 3)["state"] == "failed"
    # In-process: step 1, then an optim_step with no gradient (the failed forward_backward added
    # none), then step 2.
    from lockstep.engine.trainer import Trainer
    from lockstep.engine.types import AdamParams, Datum
    from lockstep.service.host import lora_spec

    trainer = Trainer.from_pretrained(builtin_dir, lora=lora_spec({"rank": 4, "seed": 5}))
    ds = [Datum(tuple(d.model_input.to_ints()), {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()}) for d in data]
    for fb in (True, False, True):
        if fb:
            trainer.forward_backward(ds, "cross_entropy")
        trainer.optim_step(AdamParams(learning_rate=1e-2))
    want = [o["logprobs"] for o in trainer.forward(ds, "cross_entropy").loss_fn_outputs]
    assert all((a == b).all() for a, b in zip(got, want))


# -- processes never outlive their parents ------------------------------------------------------
@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_killed_worker_takes_its_ray_and_jobs_along_and_serve_restarts_it(logged):
    """kill -9 of the worker: every process it started (Ray's GCS, raylet and agents, the
    Executor, a running job and that job's actors) is gone within seconds; all of them listened
    on loopback only; `lockstep serve` starts a new worker, /v1/health counts only it, and it
    serves. Then SIGTERM to serve stops everything within 30 s."""
    srv = logged
    serve = start_logged(srv, log=srv.log)
    first = worker_child(serve)
    with store(srv) as con:
        [(first_id,)] = con.execute("select id from endpoints where role = 'worker'").fetchall()
    job = submit_job(srv, srv.keys["gail"], *LONG_JOB)
    job_driver(first)
    procs = tree(first.pid)
    names = " ".join(describe(procs, width=None))  # whole: a job actor's name holds its (long) run directory
    assert all(n in names for n in ("gcs_server", "raylet", "RequestExecutor", "run:trainer")), names
    bound = listening(procs)
    assert bound and all(addr.ip in LOOPBACK for _, addr in bound), bound
    first.kill()
    psutil.wait_procs(procs, timeout=10)
    assert not alive(procs), describe(alive(procs))
    second = worker_child(serve, old=first.pid, timeout=60)
    assert "restarting it" in srv.log.read_text()
    health = wait_until(lambda: (h := httpx.get(f"{srv.url}/v1/health").json())["workers"] == 1 and
                        h["live_workers"][0]["id"] != first_id and h, timeout=90,
                        what="/v1/health to count only the new worker")
    assert [w["id"] for w in health["live_workers"]] != [first_id]
    tc = tinker.ServiceClient(base_url=srv.url, api_key=srv.keys["gail"]).create_lora_training_client(
        base_model="lockstep/tiny", rank=4).result()
    tc.forward(
        [sft_datum(tc.get_tokenizer(), "1+1=", "02")], "cross_entropy").result()
    job_driver(second)  # the job was requeued and resumed on the new worker
    assert job
    everything = tree(serve.pid)
    serve.send_signal(signal.SIGTERM)  # what systemd, Docker and Kubernetes send
    psutil.wait_procs(everything, timeout=30)
    assert not alive(everything), describe(alive(everything))


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_ctrl_c_stops_serve_its_worker_ray_and_jobs(logged):
    srv = logged
    serve = start_logged(srv, log=srv.log)
    worker = worker_child(serve)
    submit_job(srv, srv.keys["gail"], *LONG_JOB)
    job_driver(worker)
    everything = tree(serve.pid)
    os.killpg(serve.pid, signal.SIGINT)  # what a terminal sends its foreground process group
    psutil.wait_procs(everything, timeout=30)
    assert not alive(everything), describe(alive(everything))


# -- kill -9 anywhere, and load -------------------------------------------------------------------
@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_kill_9_of_api_worker_and_executor_mid_training_applies_every_step_once(tmp_path):
    """Each of the API, the worker (its supervisor process alone) and the Executor SIGKILLed at a
    random moment of an SDK training loop: the final weights equal an uninterrupted run's."""
    from service_harness import KINDS, Service, reference_logprobs, train_under_faults

    svc = Service(tmp_path / "svc").start()
    try:
        key = svc.tenant("hank")
        kills = random.Random(14).sample(KINDS, len(KINDS))
        run = train_under_faults(svc, key, kills, seed=14)
    finally:
        svc.stop()
    assert [kind for _, kind, _ in run.kills] == kills
    want = reference_logprobs(run.data, run.steps)
    assert all((a == b).all() for a, b in zip(run.logprobs, want)), run.kills


@pytest.mark.slow  # a two-minute load test (BENCHMARKS.md §11 reports it)
def test_32_sdk_clients_for_two_minutes_no_errors_and_flat_memory(tmp_path):
    from service_harness import Service, load

    svc = Service(tmp_path / "svc").start()
    try:
        keys = [svc.tenant(f"load{i}", max_models=32) for i in range(2)]
        run = load(svc, keys, clients=32, seconds=120, warmup_s=40)
    finally:
        svc.stop()
    assert run.errors == [], run.errors[:5]
    assert run.steps >= 32 and run.samples >= 1, (run.steps, run.samples)
    assert run.growth() < 0.10, run.rss
