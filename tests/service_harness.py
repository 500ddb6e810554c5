"""Fault and load drivers for a live service, shared by tests/test_service_faults.py (short runs,
in the default suite) and bench/service_faults.py, bench/service_load.py (long runs).

`Service` runs the API (`lockstep serve --no-worker`) and one `lockstep worker` as separate
processes, so each of the API, the worker and the worker's Executor can be killed with SIGKILL on
its own and brought back (the API and the worker by this harness, as systemd would; the Executor
by Ray)."""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import psutil
from helpers import free_port, wait_until

KINDS = ("api", "worker", "executor")


def alive(procs) -> list:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


class Service:
    def __init__(self, home: Path, *, worker_args=(), env: dict | None = None):
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.db, self.storage = f"sqlite:///{self.home / 'db.sqlite'}", str(self.home / "storage")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "LOCKSTEP_HOME": str(self.home / "lockstep"), "PYTHONWARNINGS": "ignore",
                    "TINKER_TELEMETRY": "0", **(env or {})}
        self.worker_args = list(worker_args)
        self.api: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.log = self.home / "service.log"

    def tenant(self, name: str, max_models: int = 16) -> str:
        out = subprocess.run([sys.executable, "-m", "lockstep.cli", "tenants", "create", name, "--db", self.db, "--json",
                              "--max-models", str(max_models)], check=True, capture_output=True, text=True,
                             env=self.env).stdout
        return json.loads(out.strip().splitlines()[-1])["api_key"]

    def _spawn(self, *args) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "lockstep.cli", *args, "--db", self.db, "--storage", self.storage],
                                env=self.env, start_new_session=True, stdout=open(self.log, "ab"),
                                stderr=subprocess.STDOUT)

    def start_api(self) -> None:
        self.api = self._spawn("serve", "--no-worker", "--port", str(self.port))
        wait_until(self._api_up, timeout=120, what="the API")

    def _api_up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/v1/health", timeout=2).json()["status"] == "ok"
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def start_worker(self) -> None:
        self.worker = self._spawn("worker", *self.worker_args)

    def start(self) -> "Service":
        self.start_api()
        self.start_worker()
        wait_until(self.executor, timeout=240, what="the worker's executor")
        return self

    def executor(self) -> psutil.Process | None:
        if self.worker is None or self.worker.poll() is not None:
            return None
        for p in alive(psutil.Process(self.worker.pid).children(recursive=True)):
            try:
                if "RequestExecutor" in " ".join(p.cmdline()):
                    return p
            except psutil.NoSuchProcess:
                pass
        return None

    def kill(self, kind: str) -> None:
        """SIGKILL one part (its own process only: what it started must go with it) and bring it back."""
        if kind == "api":
            self.api.kill()
            self.api.wait()
            self.start_api()
        elif kind == "worker":
            procs = [psutil.Process(self.worker.pid), *psutil.Process(self.worker.pid).children(recursive=True)]
            self.worker.kill()
            self.worker.wait()
            gone, left = psutil.wait_procs(procs, timeout=15)
            assert not alive(left), f"outlived their worker: {[p.pid for p in alive(left)]}"
            self.start_worker()
        elif kind == "executor":
            victim = self.executor()
            assert victim is not None, "no executor to kill"
            victim.kill()
        else:
            raise ValueError(kind)

    def rss(self) -> int:
        """Resident memory of the API, the worker and its Executor, in bytes."""
        total = 0
        for p in (self.api, self.worker):
            total += psutil.Process(p.pid).memory_info().rss
        ex = self.executor()
        return total + (ex.memory_info().rss if ex is not None else 0)

    def stop(self) -> None:
        for p in (self.api, self.worker):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


# -- faults --------------------------------------------------------------------------------------
def sft_data(tok):
    from tinker import types

    data = []
    for a in range(4):
        for b in range(4):
            p, ans = tok.encode(f"{a}+{b}="), tok.encode(f"{a + b:02d}") + [tok.eos_token_id]
            full = p + ans
            data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": np.array(full[1:], np.int64),
                "weights": np.array([0.0] * (len(p) - 1) + [1.0] * len(ans), np.float32)}))
    return data


@dataclass
class FaultRun:
    steps: int
    logprobs: list
    data: list
    """The training batch (SDK datums)."""
    kills: list = field(default_factory=list)
    """(seconds since start, kind, steps done when it was killed)."""
    wall_s: float = 0.0


def train_under_faults(svc: Service, key: str, kills: list[str], *, seed: int = 0, lr: float = 1e-2,
                       gap_s: tuple[float, float] = (0.0, 2.0), extra_steps: int = 2) -> FaultRun:
    """SDK training (forward_backward + optim_step per step) while `kills` happen in order, each at
    a random moment (`gap_s` after the previous one recovered and at least one more step finished,
    so no one request is hit by every kill); `extra_steps` more after the last. Returns the
    model's forward logprobs on the training data at the end."""
    import tinker
    from tinker import types

    rng = random.Random(seed)
    tc = tinker.ServiceClient(base_url=svc.url, api_key=key).create_lora_training_client(
        base_model="lockstep/tiny", rank=4, seed=5).result()
    data, adam = sft_data(tc.get_tokenizer()), types.AdamParams(learning_rate=lr)
    done, t0, events, error = [0], time.monotonic(), [], []
    finished = threading.Event()

    def killer():
        try:
            for kind in kills:
                seen = done[0]
                wait_until(lambda: done[0] > seen or finished.is_set(), timeout=600, what="a step")
                time.sleep(rng.uniform(*gap_s))
                events.append((round(time.monotonic() - t0, 2), kind, done[0]))
                svc.kill(kind)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            error.append(e)
        finally:
            finished.set()

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    remaining = None
    while remaining is None or remaining > 0:
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(adam)
        fb.result()
        opt.result()
        done[0] += 1
        if finished.is_set():
            remaining = extra_steps if remaining is None else remaining - 1
    thread.join()
    if error:
        raise error[0]
    out = tc.forward(data, "cross_entropy").result()
    return FaultRun(done[0], [o["logprobs"].to_numpy() for o in out.loss_fn_outputs], data, events,
                    time.monotonic() - t0)


def reference_logprobs(data, steps: int, lr: float = 1e-2) -> list:
    """The same training, uninterrupted, in this process."""
    from lockstep.engine.tiny import ensure_tiny_model
    from lockstep.engine.trainer import Trainer
    from lockstep.engine.types import AdamParams, Datum
    from lockstep.service.host import lora_spec

    trainer = Trainer.from_pretrained(str(ensure_tiny_model()), lora=lora_spec({"rank": 4, "seed": 5}))
    ds = [Datum(tuple(d.model_input.to_ints()), {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()}) for d in data]
    for _ in range(steps):
        trainer.forward_backward(ds, "cross_entropy")
        trainer.optim_step(AdamParams(learning_rate=lr))
    return [o["logprobs"] for o in trainer.forward(ds, "cross_entropy").loss_fn_outputs]


# -- load ----------------------------------------------------------------------------------------
@dataclass
class LoadRun:
    clients: int
    seconds: float
    steps: int
    samples: int
    errors: list
    rss: list
    """(seconds since start, bytes) every `every_s`."""
    warmup_s: float

    def growth(self) -> float:
        """RSS growth after the warm-up: the median of the last three samples over the median of
        the first three after it, minus one."""
        after = [b for t, b in self.rss if t >= self.warmup_s]
        return statistics.median(after[-3:]) / statistics.median(after[:3]) - 1


def load(svc: Service, keys: list[str], *, clients: int, seconds: float, warmup_s: float,
         every_s: float = 5.0) -> LoadRun:
    """`clients` SDK clients, each with its own LoRA model, looping forward_backward + optim_step
    and every 4th step a new sampler and a 4-sample request, for `seconds` after all are created."""
    import tinker
    from tinker import types

    counts, errors, lock = {"steps": 0, "samples": 0}, [], threading.Lock()
    ready = threading.Barrier(clients + 1)
    stop = threading.Event()

    def client(i: int):
        try:
            tc = tinker.ServiceClient(base_url=svc.url, api_key=keys[i % len(keys)]).create_lora_training_client(
                base_model="lockstep/tiny", rank=4, seed=i).result()
            tok = tc.get_tokenizer()
            rng = np.random.default_rng(i)
        except Exception as e:  # noqa: BLE001 - counted
            with lock:
                errors.append(f"client {i} setup: {type(e).__name__}: {e}")
            ready.wait()
            return
        ready.wait()
        step = 0
        while not stop.is_set():
            try:
                data = []
                for _ in range(4):
                    toks = rng.integers(4, 200, 17).tolist()
                    data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={
                        "target_tokens": np.asarray(toks[1:], np.int64), "weights": np.ones(16, np.float32)}))
                fb = tc.forward_backward(data, "cross_entropy")
                opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
                fb.result()
                opt.result()
                step += 1
                with lock:
                    counts["steps"] += 1
                if step % 4 == 0:
                    sampler = tc.save_weights_and_get_sampling_client()
                    sampler.sample(prompt=types.ModelInput.from_ints(tok.encode("12+34=")), num_samples=4,
                                   sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0)).result()
                    with lock:
                        counts["samples"] += 1
            except Exception as e:  # noqa: BLE001 - counted
                with lock:
                    errors.append(f"client {i} step {step}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    ready.wait()
    t0, rss = time.monotonic(), []
    while time.monotonic() - t0 < seconds:
        rss.append((round(time.monotonic() - t0, 1), svc.rss()))
        time.sleep(every_s)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    return LoadRun(clients, time.monotonic() - t0, counts["steps"], counts["samples"], errors, rss, warmup_s)
