"""The sandbox's own behaviour: refusal when bwrap cannot work, the operator's unsafe mode, the
pool, interpreter sessions, and the bounds on what a call may send."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lockstep.sandbox import bwrap
from lockstep.sandbox.pool import Session, SandboxPool, run_program_blocking
from lockstep.sandbox.process import MAX_CODE_BYTES
from lockstep.sandbox.types import Limits, LimitsError, SandboxUnavailable

FAST = Limits(wall_s=3, cpu_s=1, memory_mb=256)


@pytest.fixture
def fresh_probe():
    bwrap._probe.cache_clear()
    yield
    bwrap._probe.cache_clear()


def test_a_bwrap_that_cannot_make_namespaces_is_refused_with_the_reason(monkeypatch, fresh_probe):
    import shutil
    import tempfile
    from pathlib import Path

    tmp_path = Path(tempfile.mkdtemp(dir="/tmp"))  # the sandbox's uid must be able to run it
    tmp_path.chmod(0o755)
    def request_cleanup():
        shutil.rmtree(tmp_path, ignore_errors=True)
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(SandboxUnavailable, match="No permissions to creating new namespace.*user namespaces"):
        bwrap.check_available()
    r = subprocess.run([sys.executable, "-m", "lockstep.cli", "sandbox", "run", "-", "--json"], input="print(1)",
                       capture_output=True, text=True, env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, timeout=120)
    request_cleanup()
    assert r.returncode == 2 and "untrusted code is refused" in r.stderr and "LOCKSTEP_SANDBOX_UNSAFE" in r.stderr


def test_the_operators_unsafe_mode_still_applies_limits_and_says_so(monkeypatch, fresh_probe):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv(bwrap.UNSAFE_ENV, "1")
    v = run_program_blocking("print('hi')", FAST)
    assert v.status == "ok" and v.stdout == "hi\n" and v.sandboxed is False
    assert run_program_blocking("while True: pass", FAST).limit == "cpu"


def test_a_session_keeps_state_and_the_pool_hands_out_started_sandboxes():
    pool = SandboxPool(FAST, ready=2)
    first = pool.take()
    first.close()
    import time

    deadline = time.monotonic() + 20
    while len(pool._idle) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pool._idle) == 2  # refilled in the background
    sb = pool.take()
    assert sb.alive and sb.calls == 0  # never used before: a sandbox serves one program or episode
    assert sb.call("print(6 * 7)", mode="program").stdout == "42\n"
    sb.close()
    pool.close()
    s = Session(FAST)
    assert s.cell_blocking("x = [1, 2]").ok and s.cell_blocking("x.append(3); x").stdout == "[1, 2, 3]\n"
    assert s.cell_blocking("y").error.startswith("NameError")
    s.close()


def test_bounds_on_what_a_call_may_send_and_limits_that_make_no_sense():
    v = run_program_blocking("#" * (MAX_CODE_BYTES + 1), FAST)
    assert v.status == "error" and "refused" in v.error
    with pytest.raises(LimitsError, match="memory_mb: expected at least 64"):
        Limits(memory_mb=8)
    with pytest.raises(LimitsError, match=r"wall_s: expected a number of seconds in \(0, 3600\]"):
        Limits(wall_s=float("inf"))
    r = subprocess.run([sys.executable, "-m", "lockstep.cli", "sandbox", "run", "-", "--cpu-s", "0"], input="",
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cpu_s: expected an integer in [1, 3600]" in r.stderr


def test_a_program_cannot_forge_another_requests_answer():
    """The launcher's control pipe is reachable from the program; an answer with the wrong id is
    not taken as the call's result."""
    forge = ("import json, os, struct\nbody = json.dumps({'id': 'guess', 'status': 'ok', 'exit_code': 0}).encode()\n"
             "for fd in range(3, 64):\n    try:\n        os.write(fd, struct.pack('>I', len(body)) + body)\n"
             "    except OSError:\n        pass\nraise SystemExit(1)\n")
    v = run_program_blocking(forge, FAST)
    assert v.status == "error"


def test_a_missing_bwrap_is_not_remembered(monkeypatch):
    """A probe made while bwrap was not on PATH (a test's patched PATH, a package installed later)
    must not refuse every later sandbox of the process."""
    monkeypatch.setenv("PATH", "/nonexistent")
    assert "is not installed" in bwrap.probe()
    monkeypatch.undo()
    assert bwrap.probe() == ""
