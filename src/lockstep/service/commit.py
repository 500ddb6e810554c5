"""The Executor's commit protocol: a request's outcome (or its error) becomes its row's final state.

Each request is committed alone, in its own transaction, whatever batch it ran in: its result, the
store changes that go with it (Outcome.update), its usage rows and its model's done_seq. A failure
at any point fails that request and nothing else. The finish is fenced on `claimed_by` (queue.py),
so an executor whose claim was requeued behind its back drops its result, and the model in memory
that may hold the dropped request's effect (`forget`: the model is rebuilt from the store).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import insert

from lockstep.service import doorbell, queue
from lockstep.service.db import Usage
from lockstep.service.host import HostError
from lockstep.service.outcome import Outcome, UserError
from lockstep.service.types import RequestKind, ServiceError

log = logging.getLogger("lockstep.executor")
_INSERT_USAGE = insert(Usage.__table__)  # Core, built once: it runs on every request (see queue.py)
USER_ERRORS = (ServiceError, UserError, HostError)
"""What a request asked wrongly (category "user", the message for the client); anything else
raised while it ran is the server's fault."""


class CommitProtocol:
    def __init__(self, sessions, worker_id: str, host, sock, apis: doorbell.AddressBook):
        self.sessions, self.id, self.host, self.sock, self.apis = sessions, worker_id, host, sock, apis

    def settle(self, req: queue.Claimed, out: Outcome) -> None:
        """Commit an outcome, then run its clean-up and ring the API; a commit that fails fails
        the request, a request no longer ours is dropped (with what it wrote)."""
        try:
            mine = self._commit(req, out)
        except Exception as e:  # noqa: BLE001 - e.g. a value the store refuses: this request fails
            log.exception("request %s (%s): recording its result failed", req.id, req.kind)
            self.aborted(req, out)
            self.fail(req, f"internal error recording the result of {req.kind}: {type(e).__name__}: {e}", "server")
            return
        if not mine:  # requeued behind our back: its effect on the model in memory is not the store's
            log.warning("request %s was requeued while it ran here; its result is dropped", req.id)
            self.aborted(req, out)
            return
        self._after(req, out.after_commit)
        self.ring(req)

    def failed(self, req: queue.Claimed, error: BaseException) -> None:
        """Record what executing the request raised: a user error as it is, anything else as a
        server error after dropping the model it may have part-changed."""
        if isinstance(error, USER_ERRORS):
            self.fail(req, str(error), "user")
            return
        log.error("request %s (%s) failed", req.id, req.kind, exc_info=error)
        self.forget(req)
        self.fail(req, f"internal error running {req.kind}: {type(error).__name__}: {error}", "server")

    def _commit(self, req: queue.Claimed, out: Outcome) -> bool:
        with self.sessions() as s:
            if out.update is not None:
                out.update(s)
            rows = [{"tenant_id": req.tenant_id, "kind": kind.value, "amount": float(amount), "source": req.id}
                    for kind, amount in out.usage.items() if amount]
            if rows:
                s.execute(_INSERT_USAGE, rows)
            return queue.finish(s, req.id, self.id, result=out.result, result_format=out.fmt)

    def fail(self, req: queue.Claimed, error: str, category: str) -> None:
        """Record the failure alone (a fresh transaction); a store that refuses even this is a
        claim-loop failure (the request goes back to the queue when the loop recovers)."""
        with self.sessions() as s:
            mine = queue.finish(s, req.id, self.id, error=error, category=category)
        if mine:
            self.ring(req)

    def aborted(self, req: queue.Claimed, out: Outcome) -> None:
        self.forget(req)
        self._after(req, out.on_abort)

    def forget(self, req: queue.Claimed) -> None:
        """The model in memory may hold an effect the store does not: rebuild it on its next request."""
        if req.model_id is not None and RequestKind(req.kind) is not RequestKind.SAMPLE:
            self.host.drop_model(req.model_id)

    def _after(self, req: queue.Claimed, cleanup: Callable[[], None] | None) -> None:
        if cleanup is None:
            return
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - only storage is left behind; the request's outcome stands
            log.exception("request %s: storage clean-up failed", req.id)

    def ring(self, req: queue.Claimed) -> None:
        try:
            doorbell.ring(self.sock, self.apis.get(), req.id.encode())
        except Exception as e:  # noqa: BLE001 - the API's fallback poll finds the result anyway
            log.warning("could not ring the API for request %s: %s", req.id, e)
