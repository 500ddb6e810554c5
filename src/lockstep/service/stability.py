"""Sequence ids, stability records and provenance checks (Tinker's `record_stability_info`,
`SampledSequence.sequence_id` and `Datum.with_provenance`). Torch-free: the API runs it.

Every sampled sequence gets an id at submission (`sequence_ids`): a flag (recorded or not), a
random nonce and a tag binding both to the session that sampled it, so the API can tell, without
storage, whether an id was issued for a session. A sample with `record_stability_info` also gets a
StabilityRecord row per sequence (`reserve`): its prompt now, its sampled tokens, logprobs and
weights when the sample commits (`record_update`, on the worker). A record lives for RECORD_TTL after
sampling, and each training request that names it restarts that time (`touch`); a tenant holds at
most `stability_quota_tokens` of them (policy.Limits).

A datum's provenance is checked for every loss (`check_provenance`): its spans tile model_input and
target_tokens, every id was issued for the training model's session, a recorded id's record is
live and finished, and the tokens a span covers are the recorded prompt's or sampled tokens at
those offsets. An id sampled without recording is checked for its session only: its tokens were
never kept. Anything else is a 400 naming the datum, the field and the position.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import uuid
from dataclasses import dataclass
from collections.abc import Callable, Sequence

import numpy as np
from sqlalchemy import func, select

from lockstep.config.types import LOSSES
from lockstep.service import wire
from lockstep.service.db import StabilityRecord, now
from lockstep.service.types import QuotaExceeded, ServiceError

RECORD_TTL = dt.timedelta(days=1)
"""How long a record is kept after sampling, or after the last training request naming it (Tinker's day)."""
MAX_SPANS = 4096
"""Spans one datum field may carry (the cookbook emits two per turn)."""
MAX_SEQUENCES = 4096
"""Distinct sequence ids one training request may name."""
_RECORDED, _UNRECORDED = "r", "u"


# -- ids -------------------------------------------------------------------------------------------
def _tag(session_id: str, flag: str, nonce: str) -> str:
    # Unkeyed on purpose: an id names data only through its record, which is looked up with the
    # caller's tenant and session; a forged id for one's own session can only name nothing.
    return hashlib.blake2b(f"{session_id}/{flag}{nonce}".encode(), digest_size=8).hexdigest()


def sequence_ids(session_id: str, num: int, *, recorded: bool) -> list[str]:
    """`num` fresh sequence ids for samples of `session_id`."""
    flag = _RECORDED if recorded else _UNRECORDED
    nonces = [uuid.uuid4().hex[:16] for _ in range(num)]
    return [f"{flag}{n}{_tag(session_id, flag, n)}" for n in nonces]


def issued_for(session_id: str, sequence_id: str) -> bool:
    """Whether `sequence_id` is one `sequence_ids` made for `session_id`."""
    if len(sequence_id) != 33 or sequence_id[0] not in (_RECORDED, _UNRECORDED):
        return False
    return _tag(session_id, sequence_id[0], sequence_id[1:17]) == sequence_id[17:]


# -- records ---------------------------------------------------------------------------------------
def reserve(s, *, tenant, quota: int, session_id: str, sampling_session_id: str, ids: Sequence[str],
            prompt: Sequence[int], max_tokens: int) -> None:
    """Add a record per id of a sample request (its tokens come when it commits): a 429 naming
    `stability_quota_tokens` if the tenant's live records would exceed `quota` tokens. The caller
    holds the tenant's quota lock (tenants.lock_quota) and commits with the request."""
    each = len(prompt) + max_tokens
    held = s.scalar(select(func.coalesce(func.sum(StabilityRecord.num_tokens), 0))
                    .where(StabilityRecord.tenant_id == tenant.id, StabilityRecord.expires_at > now()))
    if held + each * len(ids) > quota:
        raise QuotaExceeded(f"record_stability_info: tenant {tenant.name!r} holds {held} recorded tokens and this "
                            f"request adds {len(ids)} x {each} (prompt + max_tokens); the policy's "
                            f"stability_quota_tokens is {quota}. Records expire a day after their last use; "
                            f"sample without record_stability_info, or ask the operator to raise the quota")
    packed = np.asarray(prompt, np.int32).tobytes()
    expires = now() + RECORD_TTL
    s.add_all([StabilityRecord(id=i, tenant_id=tenant.id, session_id=session_id,
                               sampling_session_id=sampling_session_id, prompt=packed, num_tokens=each,
                               expires_at=expires) for i in ids])


def record_update(body: dict, result: bytes, weights: str | None) -> Callable | None:
    """The store change that fills a recorded sample's records from its result (committed with
    it; see outcome.Outcome.update), or None if the request did not ask to record."""
    ids = body.get("sample_sequence_ids")
    if not body.get("record_stability_info") or not isinstance(ids, list):
        return None
    msg = wire.pb2().SampleResponse.FromString(result)
    assert len(msg.sequences) == len(ids), (len(msg.sequences), len(ids))

    def update(s):
        for seq_id, seq in zip(ids, msg.sequences):
            row = s.get(StabilityRecord, seq_id)
            if row is not None:  # swept already: a day passed while it ran
                row.tokens, row.logprobs, row.weights = seq.tokens, seq.logprobs, weights

    return update


# -- provenance --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Span:
    sampled: bool
    """A run of sampled tokens (else of the request's prompt)."""
    sequence_id: str
    offset: int
    length: int


def _spans(i: int, field: str, msgs) -> list[Span]:
    if len(msgs) > MAX_SPANS:
        raise ServiceError(f"datum {i}: {field} has {len(msgs)} provenance spans; at most {MAX_SPANS}")
    out = []
    for j, m in enumerate(msgs):
        arm = m.WhichOneof("span")
        if arm is None:
            raise ServiceError(f"datum {i}: {field}[{j}] is neither prompt_tokens nor sampled_tokens")
        x = getattr(m, arm)
        if x.offset < 0 or x.length < 0:
            raise ServiceError(f"datum {i}: {field}[{j}]: offset and length must be >= 0, got {x.offset} and {x.length}")
        out.append(Span(arm == "sampled_tokens", x.sequence_id, x.offset, x.length))
    return out


def datum_spans(msg) -> list[tuple[list[Span], list[Span]] | None]:
    """Per datum of a ForwardBackwardRequest: (model_input spans, loss_fn_input spans), or None."""
    out: list = []
    for i, d in enumerate(msg.data):
        if not d.model_input_spans and not d.loss_fn_input_spans:
            out.append(None)
            continue
        if not d.model_input_spans or not d.loss_fn_input_spans:
            raise ServiceError(f"datum {i}: provenance comes as a pair: set both model_input_spans and "
                               f"loss_fn_input_spans, or neither (Datum.with_provenance)")
        out.append((_spans(i, "model_input_spans", d.model_input_spans),
                    _spans(i, "loss_fn_input_spans", d.loss_fn_input_spans)))
    return out


def _check_ids(spans_D, session_id: str) -> set[str]:
    ids: set[str] = set()
    for i, pair in enumerate(spans_D):
        for field, spans in zip(("model_input_spans", "loss_fn_input_spans"), pair or ()):
            for j, sp in enumerate(spans):
                if not issued_for(session_id, sp.sequence_id):
                    raise ServiceError(f"datum {i}: {field}[{j}] names sequence_id {wire.shown(sp.sequence_id)}, "
                                       f"which was not sampled in this model's session (provenance works within "
                                       f"one session: sample and train in the same one)")
                ids.add(sp.sequence_id)
    if len(ids) > MAX_SEQUENCES:
        raise ServiceError(f"provenance names {len(ids)} sequences; one request may name at most {MAX_SEQUENCES}")
    return ids


def _records(s, tenant_id: str, session_id: str, ids: set[str]) -> dict[str, StabilityRecord]:
    recorded = sorted(i for i in ids if i[0] == _RECORDED)
    rows = {r.id: r for r in s.scalars(select(StabilityRecord).where(StabilityRecord.id.in_(recorded)))} if recorded else {}
    at = now()
    for sid in recorded:
        row = rows.get(sid)
        if row is None or row.expires_at <= at:
            raise ServiceError(f"sequence_id {sid} has expired: recorded sequences are kept for one day after "
                               f"sampling or after the last training request that names them; sample again")
        if row.tenant_id != tenant_id or row.session_id != session_id:  # the tag makes this a defence in depth
            raise ServiceError(f"sequence_id {sid} was not sampled in this model's session")
        if row.tokens is None:
            raise ServiceError(f"sequence_id {sid} has no sampled tokens: its sample request has not finished "
                               f"(or failed); wait for its result before training on it")
    return rows


def _check_field(i: int, field: str, tokens: np.ndarray, spans: list[Span], rows) -> None:
    total = sum(sp.length for sp in spans)
    if total != len(tokens):
        raise ServiceError(f"datum {i}: {field} cover {total} positions but the field has {len(tokens)}; "
                           f"the runs must tile it exactly")
    pos = 0
    for sp in spans:
        row = rows.get(sp.sequence_id)
        if row is not None:
            what = "sampled tokens" if sp.sampled else "prompt"
            src = np.frombuffer(row.tokens if sp.sampled else row.prompt, np.int32)
            if sp.offset + sp.length > len(src):
                raise ServiceError(f"datum {i}: {field} at position {pos} names positions [{sp.offset}, "
                                   f"{sp.offset + sp.length}) of sequence {sp.sequence_id}'s {what}, which has "
                                   f"{len(src)} tokens")
            got = tokens[pos:pos + sp.length]
            bad = np.flatnonzero(got != src[sp.offset:sp.offset + sp.length])
            if bad.size:
                k = int(bad[0])
                raise ServiceError(f"datum {i}: {field} position {pos + k} is token {int(got[k])}, but sequence "
                                   f"{sp.sequence_id}'s {what} has token {int(src[sp.offset + k])} at offset "
                                   f"{sp.offset + k}")
        pos += sp.length


def check_provenance(s, *, tenant_id: str, session_id: str, msg, fb) -> list[str]:
    """Check every datum's provenance (module docstring) against the training model's session:
    a ServiceError naming the datum and position, or the recorded ids it names (to `touch`)."""
    spans_D = datum_spans(msg)
    if not any(spans_D):
        return []
    rows = _records(s, tenant_id, session_id, _check_ids(spans_D, session_id))
    for i, (pair, d) in enumerate(zip(spans_D, fb.data)):
        if pair is None:
            continue
        targets = d.loss_fn_inputs.get("target_tokens")
        if targets is None or targets.ndim != 1:
            raise ServiceError(f"datum {i}: provenance needs a 1-D target_tokens for loss_fn_input_spans to tile")
        _check_field(i, "model_input_spans", np.asarray(d.model_input, np.int64), pair[0], rows)
        _check_field(i, "loss_fn_input_spans", targets.astype(np.int64), pair[1], rows)
    return sorted(rows)


def touch(s, ids: Sequence[str]) -> None:
    """Restart the kept day of the records a training request named (committed with it)."""
    if ids:
        expires = now() + RECORD_TTL
        for row in s.scalars(select(StabilityRecord).where(StabilityRecord.id.in_(list(ids)))):
            row.expires_at = expires


# -- stable_reinforce ------------------------------------------------------------------------------
STABLE_REINFORCE_OVERRIDES = (
    ("tinker_cookbook.recipes.rl_loop", "loss_fn=importance_sampling"),
    ("tinker_cookbook.recipes.math_rl.train (sync and async)", "loss_fn=importance_sampling"),
    ("tinker_cookbook.recipes.rubric.train (sync and async)", "loss_fn=importance_sampling"),
    ("tinker_cookbook.recipes.rubric.prometheus_experimental", "loss_fn=importance_sampling"),
    ("tinker_cookbook.recipes.code_rl.train and harbor_rl.train (async only; no loss flag)",
     "leave max_steps_off_policy unset (synchronous)"),
    ("your own rl.train.Config with async_config", 'AsyncConfig(..., loss_fn="importance_sampling")'),
)
"""Each cookbook 0.6.1 entry point that defaults to stable_reinforce, and the one override that
runs it on another loss (its CLI flag, or the config field a script sets)."""


def refuse_stable_reinforce(loss_fn: str) -> None:
    """stable_reinforce's objective is unpublished (Tinker's losses page describes its inputs,
    not its math), so it is refused, with the override each cookbook entry point needs."""
    if loss_fn != "stable_reinforce":
        return
    overrides = "; ".join(f"{where}: {flag}" for where, flag in STABLE_REINFORCE_OVERRIDES)
    raise ServiceError(f"loss 'stable_reinforce' is not supported by this server: Tinker has not published its "
                       f"objective, so it cannot be reproduced faithfully. Train on another loss (supported: "
                       f"{', '.join(LOSSES)}); provenance spans and record_stability_info work with any loss. "
                       f"The one override per cookbook entry point: {overrides}")
