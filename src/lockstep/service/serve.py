"""`lockstep serve` and `lockstep worker`: the two processes of the service.

`serve` runs the API (uvicorn) and, unless told otherwise, one worker as a child process; either
can be killed and restarted on its own, since they share nothing but the store and the storage.
The API process never imports torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from lockstep.config.types import DEVICES, DRAFTERS, DTYPES
from lockstep.memlimit import MODES as MEMORY_MODES

log = logging.getLogger("lockstep.serve")


def service_home() -> Path:
    return Path(os.environ.get("LOCKSTEP_HOME", Path.home() / ".cache" / "lockstep")) / "service"


def default_db() -> str:
    home = service_home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'service.db'}"


def default_storage() -> str:
    return str(service_home() / "storage")


def parse_models(items) -> dict:
    out = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path, "config.json").is_file():
            raise SystemExit(f"--model {item!r}: expected NAME=PATH of a Hugging Face model directory")
        out[name] = path
    return out


WORKER_GRACE_S = 20.0
"""How long a stopping `lockstep serve` waits for its worker to stop cleanly before killing it; with
uvicorn's own 5 s and the guardian's sweep, everything is gone well within 30 s."""


class WorkerChild:
    """`lockstep serve`'s worker process, restarted when it dies (after 1 s, doubling up to 60 s
    while it keeps dying within a minute of its start)."""

    MAX_PAUSE_S = 60.0
    STABLE_S = 60.0

    def __init__(self, argv: list):
        self.argv = argv
        self.proc: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="worker-restarter", daemon=True)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv)
        self._thread.start()

    def _watch(self) -> None:
        pause, started = 1.0, time.monotonic()
        while not self._stopping.wait(0.5):
            code = self.proc.poll()
            if code is None:
                if time.monotonic() - started > self.STABLE_S:
                    pause = 1.0
                continue
            log.warning("the worker (pid %d) exited with status %s; restarting it in %.0f s", self.proc.pid, code, pause)
            if self._stopping.wait(pause):
                return
            self.proc, started = subprocess.Popen(self.argv), time.monotonic()
            log.info("restarted the worker: pid %d", self.proc.pid)
            pause = min(2 * pause, self.MAX_PAUSE_S)

    def stop(self, grace_s: float = WORKER_GRACE_S) -> None:
        """SIGTERM (the worker finishes the request in hand, preempts its jobs), then SIGKILL; its
        guardian then kills whatever it had started."""
        self._stopping.set()
        self._thread.join()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("the worker did not stop within %.0f s; killing it", grace_s)
                self.proc.kill()
                self.proc.wait()


def _exit_on_sigterm() -> None:
    """uvicorn handles SIGTERM itself, then re-raises it to the previous handler once it has shut
    down; with the default handler that killed this process before it could stop its worker."""

    def handler(signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def start_alerts(db: str, rules_path: str | None, webhook_url: str | None) -> None:
    """Evaluate the service's alert rules every 10 s over its health record (service_metrics.py);
    events go to $LOCKSTEP_HOME/service/alerts.jsonl and to the webhook."""
    from lockstep.monitor import alerts
    from lockstep.service.db import connect
    from lockstep.service.service_metrics import service_record

    rules = alerts.load_rules(rules_path, default=alerts.SERVICE_RULES)
    webhook = alerts.Webhook(webhook_url) if webhook_url else None
    _, sessions = connect(db)
    alerts.watch(service_home(), rules, webhook, every_s=10.0, source=lambda: service_record(sessions))
    log.info("service alerts: %d rules -> %s%s", len(rules), service_home() / "alerts.jsonl",
             f" and {webhook_url}" if webhook_url else "")


def run_api(*, host: str, port: int, db: str, storage: str, max_body_mb: int, worker_args: list | None,
            policy=None, alert_rules: str | None = None, alert_webhook: str | None = None) -> int:
    import uvicorn

    from lockstep import raylocal
    from lockstep.service import http_head
    from lockstep.service.app import ServiceConfig, create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    alerting = bool(alert_rules or alert_webhook)
    app = create_app(ServiceConfig(db_url=db, storage_url=storage, max_body_bytes=max_body_mb * 1024 * 1024,
                                   policy=policy, operator_token=os.environ.get("LOCKSTEP_OPERATOR_TOKEN") or None,
                                   alerts_path=str(service_home() / "alerts.jsonl") if alerting else None))
    _exit_on_sigterm()
    if alerting:
        start_alerts(db, alert_rules, alert_webhook)
    child = None
    if worker_args is not None:
        raylocal.guard()  # the worker, and all it starts, die with this process
        child = WorkerChild([sys.executable, "-m", "lockstep.cli", "worker", "--db", db, "--storage", storage,
                             *worker_args])
        child.start()
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                    http=http_head.protocol(), h11_max_incomplete_event_size=http_head.MAX_HEAD_BYTES)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if child is not None:
            child.stop()
    return 0


def run_worker(*, db: str, storage: str, **options) -> int:
    from lockstep.service.types import WorkerConfig
    from lockstep.service.worker import Worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    worker = Worker(WorkerConfig(db_url=db, storage_url=storage, home=str(service_home() / "worker"), **options))
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())  # Ctrl-C on `lockstep serve` reaches its worker too
    worker.start()
    worker.serve_forever()
    return 0


WORKER_OPTIONS = (  # (flag, WorkerConfig field, type, help): shared by `lockstep worker` and `lockstep serve`
    ("--ray-address", "ray_address", str, "join this Ray cluster instead of starting a loopback-only one "
                                          "(see docs/architecture.md, Security model)"),
    ("--persist-every", "persist_every", int, "optimizer steps between durable model states"),
    ("--job-slots", "job_slots", int, "jobs the worker runs at once"),
    ("--max-attempts", "max_attempts", int, "executor crashes a request may cause before it is failed"),
    ("--max-models", "max_models", int, "trainers kept in memory (least recently used rebuilt on demand)"),
    ("--max-samplers", "max_sessions", int, "sampling sessions' weights kept in memory"),
    ("--max-batch-tokens", "max_batch_tokens", lambda v: _at_least(v, 1, 1 << 30), "token budget of one packed batch of requests (tenants share it "
                                                    "by their policy batch_weight)"),
    ("--model-cache-mb", "model_cache_bytes", lambda v: _at_least(v, 0, 1 << 30),
     "MiB of tensors the worker holds: shared bases, adapters with their gradients and optimizer moments, full "
     "trainers, sampler weights; least recently used evicted to disk beyond it (0: half the machine's memory)"),
    ("--fetch-cache-mb", "fetch_cache_bytes", int, "local cache of downloaded saved states, in MiB"),
    ("--janitor-every", "janitor_every_s", float, "seconds between deletions of expired checkpoints"),
    ("--session-ttl", "session_ttl_s", float, "seconds after a session's last heartbeat its sampler snapshots "
                                              "are deleted"),
    ("--device", "device", lambda v: _choice(v, DEVICES),
     "where the engine host computes: cpu, or cuda (Triton kernels on a GPU; needs the gpu extra)"),
    ("--dtype", "dtype", lambda v: _choice(v, DTYPES), "float32, or bfloat16 (with --device cuda)"),
    ("--speculative", "speculative", lambda v: _choice(v, DRAFTERS),
     "speculative decoding in sampling sessions: off, suffix or model (samples and logprobs never change)"),
    ("--draft-tokens", "draft_tokens", lambda v: _at_least(v, 1, 64), "tokens drafted per row and step, at most"),
    ("--job-memory", "job_memory", lambda v: _choice(v, MEMORY_MODES),
     "how a job's memory is capped (the policy's max_job_memory_mb): auto (a cgroup per job where possible, "
     "else RLIMIT_AS per process), cgroup (refuse to start without one) or rlimit"),
)


MIB_OPTIONS = ("fetch_cache_bytes", "model_cache_bytes")
"""WorkerConfig byte fields given in MiB on the command line."""


def _choice(value: str, choices: tuple) -> str:
    if value not in choices:
        raise argparse.ArgumentTypeError(f"{value!r}: choose one of {', '.join(choices)}")
    return value


def _at_least(text: str, low: int, high: int) -> int:
    value = int(text)
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{text}: expected an integer in [{low}, {high}]")
    return value


def add_worker_options(parser) -> None:
    from lockstep.service.types import WorkerConfig

    defaults = WorkerConfig(db_url="", storage_url="", home="")
    for flag, name, kind, text in WORKER_OPTIONS:
        default = getattr(defaults, name)
        if name in MIB_OPTIONS:
            default //= 1 << 20
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})" if default != "" else text)


def worker_options(args) -> dict:
    """WorkerConfig fields from parsed options."""
    out = {name: getattr(args, flag[2:].replace("-", "_")) for flag, name, _, _ in WORKER_OPTIONS}
    for name in MIB_OPTIONS:
        out[name] = int(out[name]) << 20
    out["ray_address"] = out["ray_address"] or ""
    return out


def worker_argv(args) -> list:
    """The same options, as `lockstep worker` arguments (what `lockstep serve` starts its worker with)."""
    out = []
    for flag, _, _, _ in WORKER_OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value not in (None, ""):
            out += [flag, str(value)]
    return out
