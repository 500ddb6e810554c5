"""The trainer's forward and forward_backward over the datums of several models in one pass.

Each model (a LoRA client on one shared base, engine/adapters.py, or the bare base for a forward)
brings its datums, loss and loss config: a `TrainGroup`. Its loss, metrics, per-token logprobs
and adapter gradients equal, bit for bit, those of the same call alone (which is this function
with one group), however many models share the pass and in what order:

* Layout. Each group is laid out as it is alone: its datums in order, right-padded to its own
  longest (T_g); the groups' rows are stacked and padded to the longest of all, and the padding
  past a group's own T_g runs on the bare base (AdapterAssignment.tokens), so an adapter's
  gradient products run over exactly the rows it has alone (engine/multi_lora.py). A group whose
  datums share prompts (engine/prefix.py plans it per group: a prefix is shared only within one
  model) goes through the shared-prefix forward, with every other such group: one forward of all
  their prefixes, one of all their suffixes; the other groups through one plain forward.
* Forward. The forward is row-invariant (a row's bits never depend on the rest of the batch), so a
  token's logprob is its alone value; each group's logprobs come out of one split (its gradient
  is a concatenation, never a sum with another group's).
* Loss. Each group's loss runs on its own datums (its own normalisation, segments, config); the
  backward runs once on the sum of the finite losses, into those groups' adapters only. A group
  whose loss is refused or not finite fails alone (its gradients are not touched, as alone); so
  does a group whose datums are refused, before any compute.
* Gradients. Only adapter factors carry gradients (the base is frozen); each adapter's come from
  its own rows, one term per forward it takes part in, as alone. A model may appear in one group
  per call (a second would sum its two gradients in another order than two calls do).

Returns one result per group, in order: its ForwardBackwardOutput, or the error it failed with (a
ValueError: EngineError, or the loss's LossError).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from lockstep.engine.batching import Batch
from lockstep.engine.prefix import PrefixPlan, plan_prefixes, shared_prefix_logsoftmax
from lockstep.engine.trainer import checked_batch, loss_of, outputs_of
from lockstep.engine.types import AdapterAssignment, EngineError, ForwardBackwardOutput, TrainGroup


@dataclass
class _Group:
    """One accepted group: its index in the call, checked batch, adapter slot and prefix plan."""

    index: int
    spec: TrainGroup
    batch: Batch
    slot: int  # index into the call's adapters, -1 for the bare base
    plan: PrefixPlan | None


def packed_forward(base, groups: Sequence[TrainGroup]) -> list[ForwardBackwardOutput | ValueError]:
    """Logprobs, losses and metrics of every group, without touching gradients."""
    with torch.no_grad(), base.model.compute.scope():
        return _run(base, groups, backward=False)


def packed_forward_backward(base, groups: Sequence[TrainGroup]) -> list[ForwardBackwardOutput | ValueError]:
    """Accumulate each model's adapter gradients of its own sum of elementwise losses."""
    with torch.enable_grad(), base.model.compute.scope():
        return _run(base, groups, backward=True)


def _run(base, groups: Sequence[TrainGroup], *, backward: bool) -> list:
    results: list = [None] * len(groups)
    accepted, adapters = _accept(base, groups, backward, results)
    if not accepted:
        return results
    lp_of, entropy_of = _logprobs(base.model, accepted, tuple(adapters))
    total = None
    done = []
    for g in accepted:
        try:  # a loss that refuses its config or inputs fails its group alone, before any backward
            elementwise, metrics = loss_of(g.batch, lp_of[g.index], g.spec.loss_fn, g.spec.loss_fn_config)
        except ValueError as e:
            results[g.index] = e
            continue
        loss = elementwise.sum()
        entropy_T = entropy_of[g.index]
        if "weights" in g.batch.floats:
            entropy_T = entropy_T[g.batch.floats["weights"] > 0]
        if entropy_T.numel():
            metrics = {**metrics, "entropy:mean": float(entropy_T.mean())}
        if backward and not torch.isfinite(loss):
            results[g.index] = EngineError(f"loss is {float(loss.detach())}; gradients were not applied")
            continue
        done.append((g, elementwise, metrics, loss))
        total = loss if total is None else total + loss
    if backward and total is not None:
        # Only the models whose loss went through: a group that failed after the forward (its loss
        # refused, or not finite) keeps its gradients untouched, as alone (its rows would add zeros).
        leaves = [t for g, *_ in done for f in g.spec.model.adapter.factors.values() for t in (f.a, f.b)]
        total.backward(inputs=leaves)
    for g, elementwise, metrics, loss in done:
        results[g.index] = outputs_of(g.batch, lp_of[g.index], elementwise, metrics, loss.detach())
    return results


def _accept(base, groups, backward: bool, results: list) -> tuple[list[_Group], list]:
    """Check every group before any compute; a refused one gets its EngineError in `results`."""
    accepted, adapters, seen = [], [], {}
    for i, spec in enumerate(groups):
        try:
            if not isinstance(spec, TrainGroup):
                raise EngineError(f"group {i} is a {type(spec).__name__}, expected a TrainGroup")
            model = spec.model
            if model is None and backward:
                raise EngineError(f"group {i}: the bare base has nothing to train; forward_backward needs a model")
            if model is not None and getattr(model, "base", None) is not base:
                raise EngineError(f"group {i}: its model is not bound to this shared base")
            if model is not None and id(model) in seen:
                raise EngineError(f"group {i}: its model already has group {seen[id(model)]} in this call; "
                                  "pack one group per model")
            batch = checked_batch(spec.data, base.vocab_size, spec.loss_fn, spec.loss_fn_config)
        except ValueError as e:  # EngineError, or the loss registry's LossError (an unknown loss)
            results[i] = e
            continue
        slot = -1
        if model is not None:
            seen[id(model)] = i
            slot = len(adapters)
            adapters.append(model.adapter)
        share = model.share_prefixes if model is not None else True
        plan = plan_prefixes([tuple(d.model_input) for d in spec.data]) if share else None
        accepted.append(_Group(i, spec, batch, slot, plan))
    return accepted, adapters


def _logprobs(model, accepted: list[_Group], adapters: tuple) -> tuple[dict, dict]:
    """Per group index: log p(target) at each of its valid positions (its datums in order), and the
    entropy there (no gradient)."""
    lp_of, entropy_of = {}, {}
    plain = [g for g in accepted if g.plan is None]
    shared = [g for g in accepted if g.plan is not None]
    if plain:
        _plain_forward(model, plain, adapters, lp_of, entropy_of)
    if shared:
        _shared_forward(model, shared, adapters, lp_of, entropy_of)
    return lp_of, entropy_of


def _plain_forward(model, groups: list[_Group], adapters, lp_of, entropy_of) -> None:
    T = max(g.batch.tokens_BT.shape[1] for g in groups)
    tokens = torch.cat([_pad(g.batch.tokens_BT, T) for g in groups])
    targets = torch.cat([_pad(g.batch.targets_BT, T) for g in groups])
    valid = torch.cat([_pad(g.batch.valid_BT, T) for g in groups])
    rows = tuple(g.slot for g in groups for _ in g.batch.lengths)
    own = tuple(g.batch.tokens_BT.shape[1] for g in groups for _ in g.batch.lengths)
    assignment = AdapterAssignment(adapters, rows, own)  # an adapter's lm_head too: its rows up to its own length
    hidden = model.hidden_states(tokens, adapters=assignment)
    lp_BT, entropy_BT = model.logprobs_and_entropy(hidden, targets.to(hidden.device), assignment)
    _split(groups, lp_BT[valid.to(lp_BT.device)], entropy_BT[valid.to(lp_BT.device)], lp_of, entropy_of)


def _shared_forward(model, groups: list[_Group], adapters, lp_of, entropy_of) -> None:
    """Every group's shared prefixes in one forward, every suffix in another (engine/prefix.py);
    group g's prefix rows use its adapter up to its own longest prefix, its suffix rows up to its
    own longest suffix."""
    prefixes, owner, shared, inputs = [], [], [], []
    pre_rows, pre_own, suf_rows, suf_own = [], [], [], []
    total = sum(len(g.plan.prefixes) for g in groups)
    for g in groups:
        p = g.plan
        base = len(prefixes)
        prefixes += p.prefixes
        pre_rows += [g.slot] * len(p.prefixes)
        pre_own += [max(len(x) for x in p.prefixes)] * len(p.prefixes)
        own_suffix = max(len(d.model_input) - n for d, n in zip(g.spec.data, p.shared))
        for d, o, n in zip(g.spec.data, p.owner, p.shared):
            owner.append(base + o if o < len(p.prefixes) else total)  # `total`: the empty cache row
            shared.append(n)
            inputs.append(tuple(d.model_input))
            suf_rows.append(g.slot)
            suf_own.append(own_suffix)
    plan = PrefixPlan(tuple(prefixes), tuple(owner), tuple(shared))
    lora = (AdapterAssignment(adapters, tuple(pre_rows), tuple(pre_own)),
            AdapterAssignment(adapters, tuple(suf_rows), tuple(suf_own)))
    lsm_TV = shared_prefix_logsoftmax(model, inputs, plan, adapters=lora)
    targets = torch.cat([g.batch.targets_BT[g.batch.valid_BT] for g in groups]).to(lsm_TV.device)
    lp_T = lsm_TV.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy_T = -(lsm_TV.exp() * lsm_TV).sum(-1)
    _split(groups, lp_T, entropy_T, lp_of, entropy_of)


def _split(groups: list[_Group], lp_T, entropy_T, lp_of, entropy_of) -> None:
    """Each group's slice, through one split: the gradient flowing back is the groups' gradients
    concatenated, never added to another group's."""
    sizes = [sum(g.batch.lengths) for g in groups]
    for g, lp, ent in zip(groups, torch.split(lp_T, sizes), torch.split(entropy_T, sizes)):
        lp_of[g.index], entropy_of[g.index] = lp, ent


def _pad(t: torch.Tensor, T: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, T - t.shape[1])) if t.shape[1] < T else t
