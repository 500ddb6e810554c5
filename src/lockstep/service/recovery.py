"""The Executor's recovery: a model the host does not hold (a restarted executor, a model the LRU
dropped, or one forgotten after a failure) is rebuilt from the store before its next request.

Its durable state (written every `persist_every` optimizer steps, the pointer moved in the commit
of the request that wrote it), then a replay, in seq order, of the finished requests after it that
change the model (their results were already delivered and are not rewritten). Only finished
requests are replayed, so a failed request has no effect on the rebuilt model.
"""

from __future__ import annotations

import logging

from sqlalchemy import select

from lockstep.service.db import Request
from lockstep.service.handlers import REPLAY
from lockstep.service.outcome import UserError
from lockstep.service.types import RequestKind, RequestState

log = logging.getLogger("lockstep.executor")


class Recovery:
    def __init__(self, host, sessions):
        self.host, self.sessions = host, sessions

    def ensure_model(self, model, base_path: str) -> None:
        """Rebuild a model the host does not hold. A rebuild that fails part-way leaves nothing
        behind (the next request starts over)."""
        if self.host.has_model(model.id):
            return
        try:
            self._rebuild(model, base_path)
        except BaseException:
            self.host.drop_model(model.id)
            raise

    def _rebuild(self, model, base_path: str) -> None:
        after = -1
        if model.state_path:
            self.host.restore_state(model.id, base_path, model.lora_config, model.state_path, True)
            after = model.state_seq
        with self.sessions() as s:
            done = list(s.scalars(select(Request).where(
                Request.model_id == model.id, Request.state == RequestState.DONE.value, Request.seq_id > after,
                Request.seq_id <= model.done_seq, Request.kind.in_([k.value for k in REPLAY]))
                .order_by(Request.seq_id)))
        log.info("rebuilding %s: state at seq %d, replaying %d requests", model.id, after, len(done))
        for r in done:
            kind = RequestKind(r.kind)
            if not self.host.has_model(model.id) and kind not in (RequestKind.CREATE_MODEL, RequestKind.LOAD_WEIGHTS):
                break
            REPLAY[kind](self.host, r, model, base_path)
        if not self.host.has_model(model.id):
            raise UserError(f"model {model.id} does not exist: the request that created it failed")
