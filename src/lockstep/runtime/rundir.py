"""The run directory and the run's position in it.

A run directory holds config.json, metrics.jsonl, ledger.jsonl, checkpoints/ (step-N and final),
final_model/, summary.json and report.html. A run's progress is its *position* (stage, step, data
cursor, evaluations, counters and the ledger snapshot), committed inside every trainer checkpoint.
`--resume DIR` (and recovery from a crashed trainer) continues from the newest complete
checkpoint; records past it are dropped, since the steps after it are run again.

A torn checkpoint (one that fails its manifest check) is passed over with a warning naming it and
what is wrong. When checkpoints exist but every one is torn, resuming is refused: starting over
would silently throw the run away (and its records with it). A run that never committed a
checkpoint starts over from the base model, saying so.

One writer per directory: a run holds `writer_lock` (an flock on run.lock, which names its holder)
while it runs; a second run or `--resume` on a live directory is refused, naming the holder. The
kernel drops the lock when its process dies, however it dies, so a dead run's directory is taken
over as is. The lock is the driver's: the run's Ray actors (its children, or a job's actors on the
worker's Ray) write checkpoints and envs.log under it and go when it does.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path

from lockstep.config import ConfigError, RunSpec, to_dict
from lockstep.monitor.metrics import MetricsLogger
from lockstep.monitor.trace import SpanLog
from lockstep.runtime import controller as ctl
from lockstep.runtime.ledger import Ledger

log = logging.getLogger("lockstep.run")

PREEMPT = threading.Event()
"""Set (by SIGTERM, see `lockstep run`) to checkpoint at the next step boundary and stop."""

LIFETIME_COUNTERS = ("runtime/restarts", "runtime/rollbacks", "runtime/mixed_forward", "runtime/forward_refused")
"""Counters of what happened to this process's run, kept across a rollback to a checkpoint
(the other counters go back with the position)."""


class Preempted(Exception):
    """The run checkpointed and stopped on request; `--resume` continues it."""


class RunDirError(ConfigError):
    """A run directory that cannot be continued; the message says why and what to do."""


LOCK_FILE = "run.lock"
_locks: dict[Path, list] = {}
"""Run directories this process holds: resolved path -> [fd, depth] (writer_lock is reentrant)."""


def check_writer(run_dir: Path) -> None:
    """RunDirError, naming the holder, when a live process is writing `run_dir`; creates and
    changes nothing (a refused `--resume` must leave the directory as it was)."""
    path = Path(run_dir).resolve()
    if path in _locks:
        return  # this process's own
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (dropped with the descriptor below)
    except BlockingIOError:
        raise _busy(path, fd) from None
    finally:
        os.close(fd)


@contextlib.contextmanager
def writer_lock(run_dir: Path):
    """Hold `run_dir`'s writer lock for the block (reentrant within a process), from before its
    first write; RunDirError when a live process holds it."""
    path = Path(run_dir).resolve()
    if path in _locks:
        _locks[path][1] += 1
    else:
        _locks[path] = [_take(path), 1]
    try:
        yield
    finally:
        _locks[path][1] -= 1
        if _locks[path][1] == 0:
            os.close(_locks.pop(path)[0])  # (closing the descriptor drops the flock)


def _take(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # CLOEXEC: no child keeps it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        error = _busy(path, fd)
        os.close(fd)
        raise error from None
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    return fd


def _busy(path: Path, fd: int) -> RunDirError:
    return RunDirError(f"{path} is being written by a live run: {_holder(fd)}. A second writer would corrupt it, so "
                       f"nothing was started or changed. Wait for that run to end, or stop it, then continue it with "
                       f"--resume {path} (or pick another --run-dir)")


def _holder(fd: int) -> str:
    try:
        h = json.loads(os.pread(fd, 4096, 0))
        return f"process {int(h['pid'])} on {str(h['host'])[:100]} (started {str(h['started'])[:40]})"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name to run.lock yet"


def actor_name(run_dir: Path, role: str) -> str:
    """Actors are named per run directory, so tools (and tests) can find them."""
    return f"lockstep:{Path(run_dir).resolve()}:{role}"


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted((Path(run_dir) / "checkpoints").glob("step-*"), reverse=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint; each newer torn one is logged, with what is wrong with it."""
    from lockstep.engine.checkpoint_io import CheckpointError, verify_checkpoint

    for path in _checkpoints(run_dir):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            log.warning("passing over torn checkpoint %s: %s", path.name, e)
    return None


def resume_checkpoint(run_dir: Path) -> Path | None:
    """Where `--resume` continues: the newest complete checkpoint, or None when the run never
    committed one (it starts over). Raises RunDirError, before anything is written, when every
    checkpoint is torn."""
    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        return ckpt
    torn = [p.name for p in _checkpoints(run_dir)]
    if torn:
        raise RunDirError(f"--resume {run_dir}: every checkpoint is torn ({', '.join(torn)}; the log above says "
                          f"what is wrong with each), so there is no committed position to continue from. "
                          f"Nothing was changed: restore a checkpoint from a copy, or start a new run "
                          f"elsewhere with --run-dir")
    if (run_dir / "ledger.jsonl").exists():
        log.warning("%s never committed a checkpoint: starting over from the base model (its recorded steps "
                    "are run again)", run_dir)
    return None


class RunDirectory:
    """One run directory: its records (metrics, ledger) and the position the run has reached."""

    def __init__(self, spec: RunSpec, run_dir: Path, c: ctl.Components):
        self.spec, self.dir, self.c = spec, Path(run_dir), c
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(json.dumps(to_dict(spec), indent=2))
        self.metrics: MetricsLogger | None = None
        self.ledger: Ledger | None = None
        self.loop: ctl.RLLoop | None = None
        """The RL stage in progress, whose own position goes into each checkpoint."""
        self.t0 = time.time()

    def _open(self, position: dict, ledger: Ledger, *, keep_through: int) -> None:
        for sink in (self.metrics, self.ledger):
            if sink is not None:
                sink.close()
        self.pos, self.ledger, self.loop = position, ledger, None
        self.metrics = MetricsLogger(self.dir, keep_through=keep_through)
        if self.c.spans is not None:
            self.c.spans.close()
        self.c.spans = SpanLog(self.dir / "trace.jsonl")
        lifetime = {k: self.c.stats[k] for k in LIFETIME_COUNTERS if k in self.c.stats}
        self.c.stats.clear()
        self.c.stats.update(position["counters"])
        for k, v in lifetime.items():
            self.c.stats[k] = max(v, self.c.stats.get(k, 0.0))
        self.t0 = time.time() - position["elapsed"]

    def start_fresh(self) -> None:
        """Start from the base model (a trainer lost before any checkpoint also lands here)."""
        log_path = self.dir / "ledger.jsonl"
        if log_path.exists():  # a restart from nothing: the log says so, and the audit starts over
            Ledger.restore({"trained": {}, "filtered": {}, "pending": []}, log_path, resumed_from="").close()
        ctl.wait(self.c.trainer.start_fresh.remote(), self.c.timeout, "trainer.start_fresh")
        self.c.publish()
        self._open({"stage": 0, "stage_step": 0, "global_step": 0, "elapsed": 0.0, "stage_elapsed": 0.0,
                    "accs": {}, "evals": [], "stage_rows": [], "counters": {}, "rl": None}, Ledger(log_path),
                   keep_through=-1)

    def restore(self, ckpt: Path) -> None:
        pos = ctl.wait(self.c.trainer.load_state.remote(str(ckpt)), self.c.timeout, "trainer.load_state")
        self.c.publish()
        ledger = Ledger.restore(pos.pop("ledger"), self.dir / "ledger.jsonl", resumed_from=ckpt.name)
        self._open(pos, ledger, keep_through=pos["global_step"])
        self.c.stats["runtime/resumes"] += 1

    def checkpoint(self) -> None:
        p = self.pos
        p["elapsed"], p["counters"] = time.time() - self.t0, dict(self.c.stats)
        if self.loop is not None:
            p["rl"] = self.loop.position()
        name = f"step-{p['global_step']:06d}"
        position = {**p, "ledger": self.ledger.checkpoint(name)}
        ctl.wait(self.c.trainer.save_state.remote(str(self.dir / "checkpoints" / name), position), self.c.timeout,
                 "trainer.save_state")
        keep = self.spec.runtime.keep_checkpoints
        for old in _checkpoints(self.dir)[keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def maybe_checkpoint(self) -> None:
        every = self.spec.runtime.checkpoint_every
        if PREEMPT.is_set():
            self.checkpoint()
            raise Preempted(f"checkpointed at step {self.pos['global_step']}")
        if every and self.pos["global_step"] % every == 0:
            self.checkpoint()

    def save_final(self) -> None:
        """The final checkpoint (marked done) and the model exported as a Hugging Face directory."""
        c, p = self.c, self.pos
        ctl.wait(c.trainer.save_state.remote(str(self.dir / "checkpoints" / "final"), {**p, "done": True,
                 "ledger": self.ledger.checkpoint("final")}), c.timeout, "save")
        ctl.wait(c.trainer.export.remote(str(self.dir / "final_model")), c.timeout, "export")

    def write_summary(self, summary: dict) -> None:
        """summary.json and report.html; then the records are closed."""
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.metrics.close()
        self.ledger.close()
        if self.c.spans is not None:
            self.c.spans.close()
            self.c.spans = None
        from lockstep.monitor.report import write_report

        write_report(self.dir, summary)
