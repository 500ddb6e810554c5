"""Job event streams against another tenant's SDK session (issue 27, item 2).

    .venv/bin/python bench/event_streams.py [--streams 32] [--jobs 4] [--rounds 5] [--old-src DIR]

A `lockstep serve` on loopback (SQLite store, one worker). Tenant "streams" follows its jobs with
`--streams` open `GET /v1/jobs/ID/events?follow=true` streams (default: its cap,
`max_event_streams`), spread over `--jobs` jobs into which the bench writes one metrics event per
job every `--event-every` seconds, straight into the store, as a running job's tail does (the jobs
themselves never start: they wait for a retry far in the future, so no job process takes CPU).
Streams start after the newest event (`--from-start`: from each job's first, so that each loaded
phase also sends every stream the jobs' history, which grows as the bench runs). Tenant "sdk" runs
SDK sessions: a LoRA training client (rank 4), 5 x (forward_backward of 8 x 24
tokens + optim_step), a sampler and one 4-sample request. Each round runs one session quiet (no
stream open) and one loaded (the streams open, checked server-side through /v1/usage), so both
see the same machine; the medians and their ratio are the result. The API's CPU seconds per
second in each phase, from /proc, say what the streams cost it.

`--old-src DIR` serves the same from another checkout's `src` (PYTHONPATH), e.g. the code before
the notifier, which polled the store every 0.5 s per stream and had no cap:
`mkdir /tmp/old && git archive d5a550f src | tar -x -C /tmp/old`, then `--old-src /tmp/old/src`.
The event writer and the clients are the same; its server gets no policy file (it would refuse
the new keys), so there is nothing to raise.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import psutil

from common import emit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import free_port, wait_until  # the tests' own, one copy


def start_server(home: Path, src: str | None, policy: str | None) -> tuple[subprocess.Popen, str, dict, str]:
    port = free_port()
    env = {**os.environ, "LOCKSTEP_HOME": str(home), "TINKER_TELEMETRY": "0", "PYTHONWARNINGS": "ignore"}
    if src:
        env["PYTHONPATH"] = src
    db = f"sqlite:///{home / 'db.sqlite'}"
    keys = {}
    for name in ("streams", "sdk"):
        out = subprocess.run([sys.executable, "-m", "lockstep.cli", "tenants", "create", name, "--db", db, "--json"],
                             check=True, capture_output=True, text=True, env=env).stdout
        keys[name] = json.loads(out.strip().splitlines()[-1])["api_key"]
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", "--port", str(port), "--db", db, "--storage",
                             str(home / "storage"), *(["--policy", policy] if policy else [])], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(900):
        try:
            if httpx.get(f"{url}/v1/health", timeout=1).json()["base_models"] >= 1:
                break
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    else:
        raise RuntimeError("lockstep serve did not come up")
    return proc, url, keys, db


def add_jobs(db: str, tenant: str, count: int) -> list[str]:
    """Jobs that never start (their next attempt is years away) but take events."""
    from sqlalchemy import select

    from lockstep.service.db import Job, JobEvent, Tenant, connect

    _, sessions = connect(db)
    with sessions() as s:
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == tenant))
        jobs = [Job(id=uuid.uuid4().hex[:16], tenant_id=tenant_id, spec={}, name=f"followed-{i}",
                    next_attempt_at=dt.datetime(2100, 1, 1)) for i in range(count)]
        s.add_all(jobs)
        s.add_all([JobEvent(job_id=j.id, kind="state", data={"state": "queued"}) for j in jobs])
        s.commit()
        return [j.id for j in jobs]


class EventWriter:
    """One metrics event per job every `every_s`, each job's in its own commit, as the scheduler's
    tail writes them from the worker's process."""

    def __init__(self, db: str, jobs: list[str], every_s: float):
        from lockstep.service.db import connect

        _, self.sessions = connect(db)
        self.jobs, self.every_s, self.written = jobs, every_s, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from lockstep.service.db import JobEvent

        step = 0
        while not self.stop.wait(self.every_s):
            step += 1
            for job in self.jobs:
                with self.sessions() as s:
                    s.add(JobEvent(job_id=job, kind="metrics", data={"step": step, "rollout/reward_mean": 0.5,
                                                                     "train/loss_sum": 1.0, "time/step_s": 1.0}))
                    s.commit()
                self.written += 1


class Streams:
    """`count` following streams held open from an event loop in a thread of this process; each
    reads and drops what comes (raw sockets: the client's own cost stays small)."""

    def __init__(self, url: str, key: str, jobs: list[str], count: int):
        self.port = int(url.rsplit(":", 1)[1])
        self.key, self.jobs, self.count = key, jobs, count
        self.received = 0
        self.statuses: list[int] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tasks: list = []

    def open(self, after: int, count: int | None = None) -> None:
        self.tasks += [asyncio.run_coroutine_threadsafe(self._one(self.jobs[i % len(self.jobs)], after), self.loop)
                       for i in range(self.count if count is None else count)]

    async def _one(self, job: str, after: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(f"GET /v1/jobs/{job}/events?follow=true&after={after} HTTP/1.1\r\nHost: x\r\n"
                     f"X-API-Key: {self.key}\r\n\r\n".encode())
        status = int((await reader.readline()).split()[1])
        self.statuses.append(status)
        try:
            while status == 200 and (chunk := await reader.read(65536)):
                self.received += len(chunk)
        finally:
            writer.close()

    def close(self) -> None:
        for f in self.tasks:
            f.cancel()
        self.tasks.clear()
        self.statuses.clear()


def open_streams(url: str, key: str) -> int:
    return httpx.get(f"{url}/v1/usage", headers={"X-API-Key": key}, timeout=60).json().get("event_streams", -1)


def sdk_session(url: str, key: str, seed: int) -> float:
    import tinker
    from tinker import types

    t = time.perf_counter()
    tc = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(
        base_model="lockstep/tiny", rank=4, seed=seed).result()
    tok, rng = tc.get_tokenizer(), np.random.default_rng(seed)
    data = []
    for _ in range(8):
        toks = rng.integers(4, 200, 25).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={
            "target_tokens": np.asarray(toks[1:], np.int64), "weights": np.ones(24, np.float32)}))
    for _ in range(5):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    sampler.sample(prompt=types.ModelInput.from_ints(tok.encode("12+34=")), num_samples=4,
                   sampling_params=types.SamplingParams(max_tokens=8)).result()
    return time.perf_counter() - t


def api_cpu(proc: subprocess.Popen) -> float:
    """CPU seconds of the API process (`lockstep serve`, not its worker child)."""
    times = psutil.Process(proc.pid).cpu_times()
    return times.user + times.system


def newest_event(db: str) -> int:
    from sqlalchemy import func, select

    from lockstep.service.db import JobEvent, connect

    _, sessions = connect(db)
    with sessions() as s:
        return s.scalar(select(func.max(JobEvent.id)))


def measure(url: str, keys: dict, proc: subprocess.Popen, streams: Streams, *, db: str, rounds: int, new: bool,
            from_start: bool) -> dict:
    quiet, loaded, cpu = [], [], {"quiet": [], "loaded": []}
    sdk_session(url, keys["sdk"], seed=99)  # warm-up: the worker's first model, the SDK's imports
    for r in range(rounds):
        c0, t0 = api_cpu(proc), time.monotonic()
        quiet.append(sdk_session(url, keys["sdk"], seed=r))
        cpu["quiet"].append((api_cpu(proc) - c0) / (time.monotonic() - t0))
        streams.open(after=0 if from_start else newest_event(db))
        wait_until(lambda: len(streams.statuses) == streams.count,
                   timeout=120, what="every stream's answer", every=0.1)
        assert set(streams.statuses) == {200}, streams.statuses
        if new:
            wait_until(lambda: open_streams(url, keys["streams"]) == streams.count,
                       timeout=120, what="the server to count the streams", every=0.1)
            streams.open(after=0, count=1)
            wait_until(lambda: len(streams.statuses) == streams.count + 1,
                       timeout=120, what="the extra stream's answer", every=0.1)
            assert streams.statuses[-1] == 429, streams.statuses[-1]  # the cap holds
        c0, t0 = api_cpu(proc), time.monotonic()
        loaded.append(sdk_session(url, keys["sdk"], seed=r))
        cpu["loaded"].append((api_cpu(proc) - c0) / (time.monotonic() - t0))
        streams.close()
        if new:
            wait_until(lambda: open_streams(url, keys["streams"]) == 0,
                       timeout=120, what="the server to release the streams", every=0.1)
    return {"quiet_s": statistics.median(quiet), "loaded_s": statistics.median(loaded),
            "ratio": statistics.median(loaded) / statistics.median(quiet),
            "quiet_all_s": [round(x, 2) for x in quiet], "loaded_all_s": [round(x, 2) for x in loaded],
            "api_cpu_quiet": statistics.median(cpu["quiet"]), "api_cpu_loaded": statistics.median(cpu["loaded"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32, help="streams the 'streams' tenant opens (default: its cap)")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--event-every", type=float, default=1.0, help="seconds between a job's events")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--old-src", help="serve from this src directory instead (the code before the notifier)")
    ap.add_argument("--from-start", action="store_true", help="streams start from each job's first event (each "
                    "loaded phase then also sends every stream the jobs' whole history); default: from the newest")
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="lockstep-bench-streams-"))
    policy = None
    if not a.old_src:
        policy = str(home / "policy.toml")
        Path(policy).write_text(f"max_event_streams_total = {max(1024, a.streams + 1)}\n"
                                f"[tenants.streams]\nmax_event_streams = {a.streams}\n")
    proc, url, keys, db = start_server(home, a.old_src, policy)
    writer = EventWriter(db, add_jobs(db, "streams", a.jobs), a.event_every)
    writer.thread.start()
    streams = Streams(url, keys["streams"], [*writer.jobs], a.streams)
    try:
        result = measure(url, keys, proc, streams, db=db, rounds=a.rounds, new=not a.old_src, from_start=a.from_start)
    finally:
        writer.stop.set()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    row = {"code": "old (a poll per stream)" if a.old_src else "notifier", "streams": a.streams, "jobs": a.jobs,
           "from_start": a.from_start,
           "event_every_s": a.event_every, "rounds": a.rounds,
           **{k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()},
           "events_written": writer.written, "stream_bytes_received": streams.received}
    emit("event_streams" + ("_old" if a.old_src else ""), [row])


if __name__ == "__main__":
    main()
