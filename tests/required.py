"""What a test needs from the machine: without it the test is skipped with the reason, unless
LOCKSTEP_REQUIRE_SERVICES=1 (set by .ci/run, whose set-up installs all of it) makes that a failure."""

import os

import pytest


def unavailable(reason: str):
    if os.environ.get("LOCKSTEP_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (LOCKSTEP_REQUIRE_SERVICES=1)")
    pytest.skip(reason)


def require_sandbox(*, hostile: bool = True) -> None:
    """bubblewrap usable here; `hostile`: also refuse LOCKSTEP_SANDBOX_UNSAFE=1 (hostile programs
    are never run unsandboxed)."""
    from lockstep.sandbox.bwrap import check_available, unsafe
    from lockstep.sandbox.types import SandboxUnavailable

    if hostile and unsafe():
        pytest.skip("LOCKSTEP_SANDBOX_UNSAFE=1: hostile programs are not run unsandboxed")
    try:
        check_available()
    except SandboxUnavailable as e:
        unavailable(str(e))
