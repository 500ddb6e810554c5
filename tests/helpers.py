"""Helpers the test modules share, one copy each (bench/ scripts import them too): a free local
port, and waiting on a state (never on a fixed sleep)."""

from __future__ import annotations

import socket
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, on `host` (the caller binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(pred, timeout: float = 60, what: str = "condition", every: float = 0.2):
    """pred()'s first true value, polled every `every` s: a wait on a state, with `timeout` only as
    the point where the test gives up (an AssertionError naming `what`), never as a measure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
