"""`lockstep serve` and `lockstep worker`: the two processes of the service.

`serve` runs the API (uvicorn) and, unless told otherwise, one worker as a child process; either
can be killed and restarted on its own, since they share nothing but the store and the storage.
The API process never imports torch.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path


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


def run_api(*, host: str, port: int, db: str, storage: str, max_body_mb: int, worker_args: list | None,
            policy=None) -> int:
    import uvicorn

    from lockstep.service.app import ServiceConfig, create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(ServiceConfig(db_url=db, storage_url=storage, max_body_bytes=max_body_mb * 1024 * 1024,
                                   policy=policy))
    child = None
    if worker_args is not None:
        child = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "worker", "--db", db, "--storage", storage,
                                  *worker_args])
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        if child is not None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
    return 0


def run_worker(*, db: str, storage: str, ray_address: str, models: dict, persist_every: int, job_slots: int = 1) -> int:
    from lockstep.service.worker import Worker, WorkerConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    worker = Worker(WorkerConfig(db_url=db, storage_url=storage, home=str(service_home() / "worker"),
                                 ray_address=ray_address, models=models, persist_every=persist_every,
                                 job_slots=job_slots))
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    worker.start()
    worker.serve_forever()
    return 0
