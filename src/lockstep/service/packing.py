"""Packing: which queued requests the Executor claims and runs together, as one batch.

    queue.heads -> form_batch (pure) -> queue.claim_batch -> Handlers.execute_batch -> commit, each alone

A batch is requests of one kind (forward, forward_backward or sample; the other kinds run alone) on
one base model, from any tenants, up to a token budget (`WorkerConfig.max_batch_tokens`) and a
number of members (what the host holds at once: `min(max_models, max_sessions)`, so that readying
one member never evicts another):

- Order. Only heads are candidates: a model's next request in seq_id order, and sampling requests
  (which have no order). A batch holds at most one request per model: two requests of one model
  in one pass would sum their gradients in another order than one after the other, and the second
  would have to be undone if the first failed; a model's forward_backward calls therefore still
  accumulate one batch after another until its optim_step, which runs alone.
- Fair share. Tenants are served in proportion to the operator's weights (`Limits.batch_weight`).
  Over time: each tenant has a virtual time, the executor seconds spent on its requests divided by
  its weight (`Fairness`); the tenant furthest behind *leads* the next batch: its oldest head picks
  the batch's kind and base model and always goes in (alone, if its kind runs alone or it is larger
  than the budget), so no tenant waits for ever. Within a batch: the rest of the budget is split
  into weighted max-min fair shares of the group's tenants, each tenant's heads go in (in its
  arrival order) while they fit its share, and what is left goes to heads that fit, least-served
  first. A request larger than its tenant's share waits for a batch its tenant leads.

Claiming the chosen heads is one compare-and-set statement in the store (queue.claim_batch); the
store, not this module, decides which executor gets a request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lockstep.service import queue
from lockstep.service.types import RequestKind

PACKED_KINDS = frozenset({RequestKind.FORWARD.value, RequestKind.FORWARD_BACKWARD.value, RequestKind.SAMPLE.value})
"""Kinds whose requests share a batch; every other kind runs alone."""


@dataclass(frozen=True)
class Head:
    """A queued request that may run now."""

    id: str
    tenant: str
    """Its tenant's name (the policy's key)."""
    kind: str
    base: str
    """Its base model's name (a request of a model or sampling session the store lost: "")."""
    tokens: int
    """What it puts in a packed batch (db.Request.num_tokens); counted as at least 1."""
    order: int
    """Arrival order (unique, increasing)."""
    model: str | None = None
    """The model whose seq_id order it holds; None for a sampling request."""

    @property
    def cost(self) -> int:
        return max(1, self.tokens)


@dataclass(frozen=True)
class Batch:
    """What form_batch chose: request ids in the order they were picked (the lead's first)."""

    ids: tuple[str, ...]
    lead: str | None
    """The tenant that led it (None: no heads)."""
    lead_time: float = 0.0
    """The lead's virtual time when the batch was formed (the system's virtual time from then on)."""


def fair_shares(demand: Mapping[str, float], weights: Mapping[str, float], budget: float) -> dict[str, float]:
    """Weighted max-min fair split of `budget`: a tenant gets its demand if that is under its
    weighted part; what it leaves is shared among the others by weight (water-filling)."""
    shares: dict[str, float] = {}
    left, open_ = float(budget), {t for t, d in demand.items() if d > 0}
    while open_:
        level = left / sum(weights[t] for t in open_)
        met = {t for t in open_ if demand[t] <= level * weights[t]}
        if not met:
            shares.update({t: level * weights[t] for t in open_})
            break
        for t in met:
            shares[t] = float(demand[t])
            left -= demand[t]
        open_ -= met
    return shares


def form_batch(heads: Sequence[Head], *, budget: int, weights: Mapping[str, float],
               served: Mapping[str, float], max_members: int | None = None) -> Batch:
    """The next batch from the claimable heads. `weights`: each tenant's weight (missing: 1);
    `served`: each tenant's virtual time (missing: 0; see Fairness); `max_members`: requests in
    one batch at most (None: no cap). Pure: the same inputs give the same batch."""
    queues = _queues(heads)
    if not queues:
        return Batch((), None)
    weight = {t: float(weights.get(t, 1.0)) for t in queues}
    vt = {t: float(served.get(t, 0.0)) for t in queues}
    lead = min(queues, key=lambda t: (vt[t], queues[t][0].order))
    first = queues[lead][0]
    if first.kind not in PACKED_KINDS or first.cost > budget:
        return Batch((first.id,), lead, vt[lead])
    group = {t: [h for h in hs if (h.kind, h.base) == (first.kind, first.base)] for t, hs in queues.items()}
    group = {t: hs for t, hs in group.items() if hs}
    shares = fair_shares({t: sum(h.cost for h in hs) for t, hs in group.items()}, weight, budget)
    taken = {t: 0 for t in group}
    picked, left = [first.id], budget - first.cost
    taken[lead], group[lead] = first.cost, group[lead][1:]
    while max_members is None or len(picked) < max_members:
        fits = [t for t, hs in group.items() if hs and hs[0].cost <= left]
        if not fits:
            break
        t = min(fits, key=lambda u: (taken[u] + group[u][0].cost > shares[u],  # within its share first
                                     taken[u] / weight[u], vt[u], group[u][0].order))
        h = group[t].pop(0)
        picked.append(h.id)
        taken[t] += h.cost
        left -= h.cost
    return Batch(tuple(picked), lead, vt[lead])


def _queues(heads: Sequence[Head]) -> dict[str, list[Head]]:
    """Each tenant's heads in arrival order, at most one per model (its earliest)."""
    seen: set[str] = set()
    queues: dict[str, list[Head]] = {}
    for h in sorted(heads, key=lambda h: h.order):
        if h.model is not None:
            if h.model in seen:
                continue
            seen.add(h.model)
        queues.setdefault(h.tenant, []).append(h)
    return queues


class Fairness:
    """Each tenant's virtual time: executor seconds spent on its requests divided by its weight,
    counted from the system's virtual time (the lead's, at the last batch) when it last had none
    waiting, so that a tenant back from idle neither owes for its past nor saves up for its future
    (start-time fair queueing). Only tenants ahead of the system's time are remembered."""

    def __init__(self):
        self.now = 0.0
        self._ahead: dict[str, float] = {}

    def served(self, tenants) -> dict[str, float]:
        return {t: max(self._ahead.get(t, self.now), self.now) for t in tenants}

    def charge(self, lead_time: float, seconds: Mapping[str, float], weights: Mapping[str, float]) -> None:
        """After a batch led at `lead_time`: each tenant's seconds in it, over its weight."""
        self.now = max(self.now, lead_time)
        for t, s in seconds.items():
            self._ahead[t] = max(self._ahead.get(t, self.now), self.now) + s / float(weights.get(t, 1.0))
        self._ahead = {t: v for t, v in self._ahead.items() if v > self.now}


def split_seconds(seconds: float, costs: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """A batch's executor time, shared among its tenants by the tokens of their requests in it."""
    total = sum(sum(c) for c in costs.values())
    return {t: seconds * sum(c) / total for t, c in costs.items()} if total else {}


@dataclass(frozen=True)
class Claim:
    """A claimed batch: the requests this executor now owns, in the order they were picked."""

    members: tuple[queue.Claimed, ...]
    batch: Batch
    heads: Mapping[str, Head]
    """The chosen heads by request id (their tenants and token counts)."""

    @property
    def kind(self) -> str:
        return self.members[0].kind


class Packer:
    """The claim loop's packing: the fairness state, the budget and the operator's weights."""

    ATTEMPTS = 3
    """Batches formed per claim when other executors take all of the chosen heads first."""

    def __init__(self, budget: int, weight_of: Callable[[str], float], max_members: int):
        assert budget >= 1 and max_members >= 1
        self.budget, self.weight_of, self.max_members = budget, weight_of, max_members
        self.fairness = Fairness()

    def claim(self, session, worker_id: str) -> Claim | None:
        """Form a batch from the store's heads and claim it; None when nothing is claimable (or
        other executors kept taking everything this one chose: the next call looks again)."""
        for _ in range(self.ATTEMPTS):
            heads = [self._head(r) for r in queue.heads(session)]
            if not heads:
                return None
            tenants = {h.tenant for h in heads}
            batch = form_batch(heads, budget=self.budget, weights={t: self.weight_of(t) for t in tenants},
                               served=self.fairness.served(tenants), max_members=self.max_members)
            members = queue.claim_batch(session, batch.ids, worker_id)
            if members:
                by_id = {h.id: h for h in heads}
                return Claim(tuple(members), batch, {m.id: by_id[m.id] for m in members})
        return None

    def _head(self, row) -> Head:
        # A row without a count (stored before the column existed) counts as a whole batch.
        tokens = self.budget if row.num_tokens is None else row.num_tokens
        return Head(row.id, row.tenant, row.kind, row.base or "", tokens, row.order, row.model_id)

    def charge(self, claim: Claim, seconds: float) -> dict[str, float]:
        """Charge a batch's executor time to its tenants; returns each member's part of it (by its
        tokens), its compute seconds."""
        costs: dict[str, list[int]] = {}
        for h in claim.heads.values():
            costs.setdefault(h.tenant, []).append(h.cost)
        self.fairness.charge(claim.batch.lead_time, split_seconds(seconds, costs),
                             {t: self.weight_of(t) for t in costs})
        total = sum(h.cost for h in claim.heads.values())
        return {i: seconds * h.cost / total for i, h in claim.heads.items()}
