"""The worker's supervisor (`lockstep worker`): registers base models, starts Ray (loopback-only on
one machine, or joins `--ray-address`), keeps one Executor actor (service/executor.py) claiming
requests, and runs the job scheduler and the janitor.

Nothing it starts outlives it: `raylocal.guard()` kills the Ray cluster it started, the Executor
and every job process when it dies, however it dies. A failing scheduler tick or janitor pass is
logged and retried after a growing pause; it never ends the worker.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lockstep import memlimit, raylocal
from lockstep.config import ConfigError
from lockstep.runtime.plan import require_gpus, visible_gpus
from lockstep.service import janitor, queue
from lockstep.service.db import BaseModelEntry, connect
from lockstep.service.executor import Executor
from lockstep.service.policy import from_env
from lockstep.service.scheduler import SLOT, Scheduler, adopt_orphans
from lockstep.service.storage import Storage
from lockstep.service.types import BUILTIN_MODEL, WorkerConfig

log = logging.getLogger("lockstep.worker")
STOP_WAIT_S = 15.0
"""How long a stopping worker waits for the request in hand (`lockstep serve` kills it after 20 s)."""


def register_base_models(session, models: dict) -> None:
    """Record every base model the workers can load; `lockstep/tiny` always."""
    for name, path in models.items():
        cfg = json.loads((Path(path) / "config.json").read_text())
        session.merge(BaseModelEntry(name=name, path=str(Path(path).resolve()), arch=cfg.get("model_type", "unknown"),
                                     vocab_size=int(cfg["vocab_size"]),
                                     max_context_length=int(cfg.get("max_position_embeddings", 2048))))
    session.commit()


def job_memory(mode: str) -> memlimit.Backend:
    """How jobs' memory is capped here, said at start (MemoryLimitError, ending the start, when
    the operator asked for a cgroup and there is none)."""
    try:
        backend = memlimit.detect(mode)
    except memlimit.MemoryLimitError as e:
        raise ConfigError(str(e)) from None
    log.info("job memory limits: %s", backend.why)
    if not backend.cgroup:
        log.warning("jobs with model.device = 'cuda' run without a memory cap here: CUDA maps more address space "
                    "than RLIMIT_AS can allow (give the worker a cgroup with the memory controller)")
    return backend


class Retrying:
    """Runs a periodic duty; a failure is logged and the duty paused, twice as long each time in
    a row (up to `max_pause_s`), instead of ending the loop that runs it."""

    def __init__(self, name: str, fn, every_s: float = 0.0, max_pause_s: float = 30.0):
        self.name, self.fn, self.every_s, self.max_pause_s = name, fn, every_s, max_pause_s
        self.pause, self.next_at = 0.0, 0.0

    def __call__(self) -> None:
        if time.monotonic() < self.next_at:
            return
        try:
            self.fn()
        except Exception:  # noqa: BLE001 - logged with its traceback; the worker goes on
            self.pause = min(max(2 * self.pause, 1.0), self.max_pause_s)
            log.exception("%s failed; next try in %.0f s", self.name, self.pause)
            self.next_at = time.monotonic() + self.pause
            return
        self.pause, self.next_at = 0.0, time.monotonic() + self.every_s


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.id = f"worker-{uuid.uuid4().hex[:12]}"
        """Also the executor's: it survives the actor's restarts, so a restarted one finds its own claims."""
        self.engine, self.sessions = connect(config.db_url)
        self.storage = Storage(config.storage_url)
        self.executor = None
        self.scheduler: Scheduler | None = None
        self._stop = False

    def start(self) -> None:
        from lockstep.engine.tiny import ensure_tiny_model

        raylocal.guard()  # before anything is started: jobs, Ray and the Executor die with this process
        if self.config.device == "cuda":  # no GPU or no Triton: an error now, never a CPU fallback
            require_gpus(visible_gpus(), "--device", "start the worker with --device cpu")
        memory = job_memory(self.config.job_memory)
        home = Path(self.config.home)
        home.mkdir(parents=True, exist_ok=True)
        models = {BUILTIN_MODEL: str(ensure_tiny_model()), **self.config.models}
        with self.sessions() as s:
            register_base_models(s, models)
            requeued = queue.requeue_abandoned(s, max_attempts=self.config.max_attempts)
        if requeued:
            log.info("requeued %d requests left running by a previous worker", requeued)
        if not ray.is_initialized():
            raylocal.init(self.config.ray_address, log_to_driver=True,
                          runtime_env={"env_vars": {"MKL_CBWR": "AUTO,STRICT", "TOKENIZERS_PARALLELISM": "false"}},
                          num_cpus=os.cpu_count() or 2, resources={SLOT: self.config.job_slots})
        adopted = adopt_orphans(self.sessions)
        if adopted:
            log.info("requeued %d jobs a previous worker was running", adopted)
        address = self.config.ray_address or ray.get_runtime_context().gcs_address
        self.scheduler = Scheduler(self.sessions, self.storage, home, address, memory=memory)
        # On this node: the API rings it on loopback. num_cpus=0: it takes no Ray CPU slot, which the
        # jobs' actors need; it sets its own threads. Two threads of the actor: serve() and stop().
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.executor = Executor.options(num_cpus=0, num_gpus=1 if self.config.device == "cuda" else 0, max_restarts=-1, max_task_retries=0, max_concurrency=2,
                                         scheduling_strategy=here).remote(self.config, self.id, os.getpid(), from_env())
        ray.get(self.executor.ready.remote(), timeout=300)

    def stop(self) -> None:
        self._stop = True

    def serve_forever(self) -> None:
        duties = [Retrying("the scheduler tick", self.scheduler.tick),
                  Retrying("the janitor", self.sweep, every_s=self.config.janitor_every_s)]
        serving = self.executor.serve.remote()
        try:
            while not self._stop:
                for duty in duties:
                    duty()
                done, _ = ray.wait([serving], timeout=0.5)
                if done:
                    serving = self._served(done[0])
        finally:
            self._shutdown(serving)

    def sweep(self) -> None:
        janitor.sweep(self.sessions, self.storage, session_ttl_s=self.config.session_ttl_s)

    def _served(self, ref):
        """The executor's serve() returned: it died (Ray restarts it, it requeues its own claims and
        rebuilds models lazily), failed, or was stopped; serve again unless we are stopping."""
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:
            log.warning("the executor died (%s); Ray restarts it and its requests are requeued", e)
        except ray.exceptions.RayError:
            log.exception("the executor's claim loop ended with an error; restarting it in 1 s")
            time.sleep(1.0)
        return self.executor.serve.remote()

    def _shutdown(self, serving) -> None:
        try:
            ray.get(self.executor.stop.remote(), timeout=5)
            ray.get(serving, timeout=STOP_WAIT_S)  # the request in hand finishes first
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.warning("the executor did not stop cleanly: %s", e)
        self.scheduler.shutdown()
        ray.shutdown()
