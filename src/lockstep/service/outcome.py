"""What executing a request produces: the contract between the Executor's handlers (which build an
Outcome or raise) and its commit protocol (which commits the Outcome or records the error)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class UserError(Exception):
    """A request that cannot be run as asked (the message goes back to the client)."""


@dataclass
class Outcome:
    """What executing a request produced, and what goes with committing it."""

    result: bytes
    """The result body the client retrieves."""
    fmt: str = "json"
    """The result's format ("json" or "proto")."""
    usage: dict = field(default_factory=dict)
    """UsageKind -> amount, metered to the request's tenant in the commit."""
    update: Callable | None = None
    """Store changes committed in the same transaction as the result (called with the session)."""
    after_commit: Callable[[], None] | None = None
    """Storage clean-up once the result is committed (an old state, a replaced save)."""
    on_abort: Callable[[], None] | None = None
    """Storage clean-up when the result is not committed (what this request wrote)."""


def attempt(fn, *args):
    """fn(*args), or the exception it raised: in a batch, one member's failure is its own result."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - recorded against that member alone (commit.py)
        return e
