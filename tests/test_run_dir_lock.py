"""One writer per run directory: a live run holds its directory's lock; a second `lockstep run`
there, or the `--resume` the old message suggested, is refused (exit 2) naming the live run's
process, and the live run's records are left alone; a dead run's directory is taken over."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from lockstep.runtime.rundir import LOCK_FILE, RunDirError, check_writer, writer_lock
from test_run_e2e import CRASH, cli, rl_steps_logged

HOLDER = "import sys; from lockstep.runtime.rundir import writer_lock\n" \
         "with writer_lock(sys.argv[1]):\n    print('held', flush=True)\n    sys.stdin.read()\n"


def holder(d) -> subprocess.Popen:
    """A process holding `d`'s writer lock (it says so once it does) until its stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(d)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_live_holder_is_named_and_a_dead_ones_directory_is_taken_over(tmp_path):
    d = tmp_path / "run"
    live = holder(d)
    named = f"process {live.pid} on {socket.gethostname()}"
    for attempt in (lambda: check_writer(d), lambda: writer_lock(d).__enter__()):
        with pytest.raises(RunDirError, match=f"being written by a live run: {named}") as e:
            attempt()
        assert f"--resume {d}" in str(e.value)
    live.kill()  # SIGKILL: no chance to clean up; the kernel drops its lock
    live.wait()
    check_writer(d)
    with writer_lock(d):
        with writer_lock(d):  # reentrant within a process (the CLI holds it around run())
            assert f'"pid": {os.getpid()}' in (d / LOCK_FILE).read_text()
        check_writer(d)  # its own lock is no other writer
    holder(d).communicate("")  # released when the block ends: another process takes it


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_second_run_or_resume_on_a_live_run_directory_is_refused(tmp_path, builtin_dir):
    """The report: a second `lockstep run` said "continue it with --resume", and following that
    hint started a second writer that cut metrics.jsonl back and wrote its own summary.json."""
    d = tmp_path / "run"
    first = cli(*CRASH, f"model.path='{builtin_dir}'", "rl.steps=400", "--run-dir", str(d))
    try:
        deadline = time.time() + 300
        while rl_steps_logged(d) < 2:
            assert first.poll() is None and time.time() < deadline, first.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        for args in (("--resume", str(d)), (*CRASH, f"model.path='{builtin_dir}'", "--run-dir", str(d))):
            before = (d / "metrics.jsonl").read_bytes()
            second = cli(*args)
            assert second.wait(timeout=300) == 2
            err = second.stderr.read().decode()
            assert f"being written by a live run: process {first.pid} on {socket.gethostname()}" in err, err[-2000:]
            assert (d / "metrics.jsonl").read_bytes().startswith(before)  # nothing cut back or rewritten
            assert not (d / "summary.json").exists() and first.poll() is None
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
