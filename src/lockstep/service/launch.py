"""Starting a job attempt, off the scheduler's tick: wait for a slot (a Ray placement group), copy
the job's inputs into its directory and start its `lockstep run` process under the job's memory
limit. The scheduler runs `launch` on a thread while the job is STARTING and moves it to RUNNING
once the process exists; a cancel sets `cancel`, and the launch gives its slot back and stops
before the process starts (after, the scheduler stops the process like any other).

Nothing here touches the store: the tick thread reads what a launch needs (`Plan`) and records
what came of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from lockstep.envs.datafile import BUDGET_ENV
from lockstep.envs.registry import ALLOWLIST_ENV
from lockstep.memlimit import MiB, Backend, JobMemory
from lockstep.monitor.runfile import JsonLines
from lockstep.service.policy import Inputs, Limits, data_fields
from lockstep.service.storage import Storage
from lockstep.service.types import ServiceError

SLOT = "lockstep_job_slots"
SUPERVISOR_ENV = "LOCKSTEP_SUPERVISOR_PID"
"""Set on a job process: the pid whose death ends it (see cli.py's watchdog)."""
SLOT_WAIT_S = 60.0
"""A slot the scheduler counted as free should be granted at once; past this the attempt fails."""
CANCEL_POLL_S = 0.25
"""How often a launch waiting for its slot looks at its cancel flag."""


class LaunchCancelled(Exception):
    """The launch was asked to stop before its process started; its slot was given back."""


@dataclass(frozen=True)
class Plan:
    """What one attempt needs, read from the store by the tick thread."""

    job_id: str
    tenant_id: str
    number: int
    """The attempt's number (a preempted attempt resumes under its own)."""
    spec: dict
    """The checked spec, references unresolved."""
    inputs: Inputs
    limits: Limits
    job_dir: Path
    budget_s: float
    """Running time left to the job under max_wall_seconds."""
    resume: bool


class MetricsTail:
    """An attempt's metrics.jsonl read incrementally (a byte offset; a torn last line waits for
    the next read). A run rewrites the file when it rolls back or resumes (the records past its
    checkpoint are dropped); the records kept are not sent again: a record is its (step, time)."""

    def __init__(self, path: Path):
        self._lines = JsonLines(path)
        self._seen = {self._key(r) for r in self._lines.new()}  # an earlier attempt's, already sent

    @staticmethod
    def _key(record: dict) -> tuple:
        return record.get("step"), record.get("time")

    def new(self) -> list[dict]:
        out = []
        for record in self._lines.new():
            key = self._key(record)
            if key not in self._seen:
                self._seen.add(key)
                out.append(record)
        return out


@dataclass
class Attempt:
    job_id: str
    tenant_id: str
    number: int
    proc: subprocess.Popen
    job_dir: Path
    pg: object
    memory: JobMemory
    started: float
    """When its process started: the wall-clock cap counts from here."""
    budget_s: float
    """Running time left to the job under max_wall_seconds when this attempt started."""
    tail: MetricsTail
    signalled_at: float | None = None
    log_uploaded: float = 0.0
    stopped_for: str | None = None
    """Why the scheduler killed it (over its time or memory cap): the job then fails with this message."""

    @property
    def run_dir(self) -> Path:
        return self.job_dir / "run"

    @property
    def log_path(self) -> Path:
        return self.job_dir / f"attempt-{self.number}.log"


@dataclass
class Launch:
    """An attempt being started on a thread."""

    plan: Plan
    future: object
    """concurrent.futures.Future of `launch`: an Attempt, LaunchCancelled or the error that stopped it."""
    cancel: threading.Event = field(default_factory=threading.Event)


def launch(plan: Plan, cancel: threading.Event, *, storage: Storage, ray_address: str, memory: Backend,
           capacity: int) -> Attempt:
    """Wait for a slot, materialise the inputs and start the process; LaunchCancelled when
    `cancel` is set first. Everything taken is given back if it does not start."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{SLOT: 1}])
    limit = None
    try:
        _wait_ready(pg, cancel)
        plan.job_dir.mkdir(parents=True, exist_ok=True)
        spec = materialise(plan.spec, plan.inputs, plan.job_dir, storage=storage, capacity=capacity,
                           max_gpus=plan.limits.max_job_gpus)
        limit = JobMemory(memory, f"{plan.job_id}-{plan.number}", plan.limits.max_job_memory_mb * MiB,
                          cuda=plan.spec["model"]["device"] == "cuda")
        limit.make()
        if cancel.is_set():
            raise LaunchCancelled()
        run = plan.job_dir / "run"
        tail = MetricsTail(run / "metrics.jsonl")
        proc = _spawn(plan, spec, limit, ray_address)
    except BaseException:
        remove_placement_group(pg)
        if limit is not None:
            limit.remove()
        raise
    return Attempt(plan.job_id, plan.tenant_id, plan.number, proc, plan.job_dir, pg, limit, time.time(),
                   plan.budget_s, tail)


def _wait_ready(pg, cancel: threading.Event) -> None:
    deadline = time.monotonic() + SLOT_WAIT_S
    while not ray.wait([pg.ready()], timeout=CANCEL_POLL_S)[0]:
        if cancel.is_set():
            raise LaunchCancelled()
        if time.monotonic() > deadline:
            raise RuntimeError(f"no job slot was granted within {SLOT_WAIT_S:.0f} s")
    if cancel.is_set():
        raise LaunchCancelled()


def _spawn(plan: Plan, spec: Path, limit: JobMemory, ray_address: str) -> subprocess.Popen:
    run = plan.job_dir / "run"
    cmd = [sys.executable, "-m", "lockstep.cli", "run"]
    cmd += ["--resume", str(run)] if plan.resume else [str(spec), "--run-dir", str(run)]
    if ray_address:
        cmd += ["--ray-address", ray_address]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", SUPERVISOR_ENV: str(os.getpid()),
           ALLOWLIST_ENV: ",".join(plan.limits.user_env_modules),
           BUDGET_ENV: str(plan.limits.max_dataset_decoded_bytes), **limit.env()}  # (what the upload accepted fits)
    log = plan.job_dir / f"attempt-{plan.number}.log"
    with open(log, "a") as out:  # a preempted attempt resumes under its number: its log goes on
        if out.tell():
            out.write(f"\n--- attempt {plan.number} resumed ---\n")
            out.flush()
        return subprocess.Popen(limit.wrap(cmd), stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def materialise(d: dict, inputs: Inputs, job_dir: Path, *, storage: Storage, capacity: int, max_gpus: int = 0) -> Path:
    """spec.json for `lockstep run`: references replaced by local paths, inputs copied into the
    job's directory (kept for the resumed attempts); a CUDA job gets the GPUs it asked for
    (check_spec capped them) or, asking for the machine's (-1), the tenant's cap."""
    d = json.loads(json.dumps(d))
    local = job_dir / "inputs"
    local.mkdir(exist_ok=True)
    if inputs.model_kind == "base":
        d["model"]["path"] = inputs.model
    elif inputs.model_kind == "job":
        target = local / "model"
        if not target.is_dir():
            if not storage.has_dir(inputs.model):
                raise ServiceError(f"model.path {d['model']['path']!r}: that job's final model is not in storage")
            storage.get_dir(inputs.model, job_dir / ".model-partial")
            (job_dir / ".model-partial").rename(target)
        d["model"]["path"] = str(target)
    for name, value in data_fields(d):
        if value:
            key = inputs.datasets[value]
            target = local / key.rsplit("/", 1)[1]  # "<id>.<format>": the suite reads the suffix
            if not target.is_file():
                if not storage.exists(key):
                    raise ServiceError(f"{name}: dataset {value} is not in storage (deleted?)")
                with storage.open(key) as src, open(target.with_suffix(".partial"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
                target.with_suffix(".partial").rename(target)
            _set(d, name, str(target))
    d["runtime"]["cpus"] = max(1, int(ray.cluster_resources().get("CPU", 1)) // max(1, capacity))
    if d["model"]["device"] == "cuda" and d["runtime"]["gpus"] < 0:
        d["runtime"]["gpus"] = max_gpus
    spec = job_dir / "spec.json"
    spec.write_text(json.dumps(d))
    return spec


def _set(d: dict, name: str, value) -> None:
    """d[name] = value for a data_fields() name ("env.path", "stages[1].dataset")."""
    head, key = name.split(".")
    node = d["stages"][int(head[7:-1])] if head.startswith("stages[") else d[head]
    node[key] = value
