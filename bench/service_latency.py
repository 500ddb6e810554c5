"""The Tinker service under the official SDK: round-trip overhead, and 16 concurrent clients.

    .venv/bin/python bench/service_latency.py [--calls 60] [--clients 16] [--seconds 120]

1. forward_backward of one batch (8 datums x 24 tokens, LoRA rank 8 on the built-in model):
   `Trainer.forward_backward` in-process against `TrainingClient.forward_backward(...).result()`
   through a live `lockstep serve` on loopback, alternating with a 50 ms pause before each call,
   medians and p90 of `--calls` each.
   Also where the SDK's time goes, from the store's timestamps (queued, claimed, finished).
2. `--clients` SDK clients (0: skip), each with its own LoRA model, looping forward_backward + optim_step
   (and a 4-sample request every 5th step) for `--seconds`; errors, throughput, latency p50/p99.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from common import emit


SETTLE_S = 0.05


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def db_url(home: Path) -> str:
    return f"sqlite:///{home / 'db.sqlite'}"


def start_server(home: Path) -> tuple[subprocess.Popen, str, dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LOCKSTEP_HOME": str(home), "TINKER_TELEMETRY": "0", "PYTHONWARNINGS": "ignore"}
    db = db_url(home)
    keys = {}
    for i in range(2):
        out = subprocess.run([sys.executable, "-m", "lockstep.cli", "tenants", "create", f"t{i}", "--db", db, "--json",
                              "--max-models", "64"], check=True, capture_output=True, text=True, env=env).stdout
        keys[i] = json.loads(out.strip().splitlines()[-1])["api_key"]
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", "--port", str(port), "--db", db,
                             "--storage", str(home / "storage")], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/v1/health", timeout=1).json()["base_models"] >= 1:
                break
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    return proc, url, keys


def batch(tok, rng):
    from tinker import types

    data = []
    for _ in range(8):
        toks = rng.integers(4, 200, 25).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={
            "target_tokens": np.asarray(toks[1:], np.int64), "weights": np.ones(24, np.float32)}))
    return data


def stages(store: str, marks: list) -> dict:
    """Where the SDK's time goes, from the store's timestamps of each forward_backward request
    (set by the API at insert, by the worker at claim and at finish; same clock, same machine)."""
    import datetime as dt

    from sqlalchemy import select

    from lockstep.service.db import Request, connect

    _, sessions = connect(store)
    with sessions() as s:
        rows = list(s.execute(select(Request.created_at, Request.claimed_at, Request.finished_at)
                              .where(Request.kind == "forward_backward").order_by(Request.order)))[-len(marks):]

    def ts(d):
        return d.replace(tzinfo=dt.timezone.utc).timestamp()

    parts = {"post_to_queued": [], "queued_to_claimed": [], "claimed_to_finished": [], "finished_to_sdk": []}
    for (t0, t1), r in zip(marks, rows):
        c, cl, fi = ts(r.created_at), ts(r.claimed_at), ts(r.finished_at)
        for name, v in zip(parts, (c - t0, cl - c, fi - cl, t1 - fi)):
            parts[name].append(v)
    return {f"{k}_p50_ms": 1e3 * statistics.median(v) for k, v in parts.items()}


def overhead(url, key, calls: int, store: str) -> dict:
    import tinker

    from lockstep.engine.tiny import ensure_tiny_model
    from lockstep.engine.trainer import Trainer
    from lockstep.engine.types import Datum
    from lockstep.service.host import lora_spec

    tc = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(
        base_model="lockstep/tiny", rank=8, seed=0).result()
    local = Trainer.from_pretrained(ensure_tiny_model(), lora=lora_spec({"rank": 8, "seed": 0}))
    data = batch(tc.get_tokenizer(), np.random.default_rng(0))
    engine_data = [Datum(tuple(d.model_input.to_ints()), {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()})
                   for d in data]
    sdk, inproc, marks = [], [], []
    for i in range(calls + 3):
        # A pause before each timed call: the other call's OpenMP threads stop spinning first, so
        # neither measurement runs beside the other's leftovers, and both start from the same idle.
        time.sleep(SETTLE_S)
        t = time.perf_counter()
        local.forward_backward(engine_data, "cross_entropy")
        a = time.perf_counter() - t
        time.sleep(SETTLE_S)
        t, wall = time.perf_counter(), time.time()
        tc.forward_backward(data, "cross_entropy").result()
        b = time.perf_counter() - t
        if i >= 3:  # warm-up
            inproc.append(a)
            sdk.append(b)
            marks.append((wall, wall + b))
    return {"in_process_p50_ms": 1e3 * statistics.median(inproc), "sdk_p50_ms": 1e3 * statistics.median(sdk),
            "overhead_p50_ms": 1e3 * (statistics.median(sdk) - statistics.median(inproc)),
            "in_process_p90_ms": 1e3 * pct(inproc, 90), "sdk_p90_ms": 1e3 * pct(sdk, 90), **stages(store, marks)}


def concurrent(url, keys, clients: int, seconds: float) -> dict:
    import tinker
    from tinker import types

    lat, errors, steps = [], [], [0]
    lock = threading.Lock()
    deadline = [0.0]
    # The deadline is set by the barrier's action, before any client is released.
    ready = threading.Barrier(clients + 1, action=lambda: deadline.__setitem__(0, time.time() + seconds))

    def client(i):
        try:
            sc = tinker.ServiceClient(base_url=url, api_key=keys[i % 2])
            tc = sc.create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=i).result()
            tok = tc.get_tokenizer()
            rng = np.random.default_rng(i)
            data = batch(tok, rng)
        except Exception as e:  # noqa: BLE001 - every failure is counted, none hidden
            errors.append(repr(e))
            ready.wait()
            return
        ready.wait()
        k = 0
        while time.time() < deadline[0]:
            try:
                t = time.perf_counter()
                tc.forward_backward(data, "cross_entropy").result()
                lat_fb = time.perf_counter() - t
                tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
                if k % 5 == 0:
                    sampler = tc.save_weights_and_get_sampling_client()
                    sampler.sample(prompt=types.ModelInput.from_ints(tok.encode("12+34=")), num_samples=4,
                                   sampling_params=types.SamplingParams(max_tokens=6)).result()
                with lock:
                    lat.append(lat_fb)
                    steps[0] += 1
                k += 1
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    ready.wait()
    start = deadline[0] - seconds
    for t in threads:
        t.join()
    wall = time.time() - start
    return {"clients": clients, "seconds": round(wall, 1), "errors": len(errors), "train_steps": steps[0],
            "steps_per_s": steps[0] / wall, "fwdbwd_p50_ms": 1e3 * pct(lat, 50) if lat else None,
            "fwdbwd_p99_ms": 1e3 * pct(lat, 99) if lat else None, "first_errors": errors[:3]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=120)
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="lockstep-bench-"))
    proc, url, keys = start_server(home)
    try:
        o = overhead(url, keys[0], a.calls, db_url(home))
        c = concurrent(url, keys, a.clients, a.seconds) if a.clients else {"first_errors": []}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    emit("service_latency", [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in {**o, **c}.items()
                              if k != "first_errors"}], {"first_errors": c["first_errors"]})


if __name__ == "__main__":
    main()
