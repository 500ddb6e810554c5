"""Shared-prefix training: a group's common prompt goes through the forward once.

The datums of a GRPO step come in groups that share a prompt (8 completions of one problem). The
plain forward recomputes the prompt for each of them; here the trainer does what the sampler
does: it runs each shared prefix once into a KV cache (with autograd), copies the cache rows to
the datums that share it, and runs only the suffixes. Every token's hidden state is the same
computation as in the plain forward (rows and key lengths are invariant, see invariant.py), so the
logprobs are bit for bit the same; gradients reach the prefix through the copied cache rows,
summed in a fixed order on every device (engine/rows.py: not index_add_'s atomics on CUDA), so a
micro-batch's gradient is the same bits wherever it is computed.

`plan_prefixes` decides: datums are sorted, and neighbours whose common prefix is at least
MIN_SHARED tokens form a group (each datum keeps at least one suffix token). It returns None when
sharing would save less than MIN_SAVING of the rows, and the plain forward runs instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from lockstep.engine.rows import copy_rows
from lockstep.engine.types import AdapterAssignment

MIN_SHARED = 4
"""Shortest prefix worth sharing (tokens)."""
MIN_SAVING = 0.2
"""Fraction of forward rows that sharing must save to be used."""


@dataclass(frozen=True)
class PrefixPlan:
    prefixes: tuple[tuple[int, ...], ...]
    """Distinct shared prefixes."""
    owner: tuple[int, ...]
    """Per datum: index of its prefix, or len(prefixes) for none (an empty cache row)."""
    shared: tuple[int, ...]
    """Per datum: shared prefix length (0 for none)."""


def _lcp(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def _groups(inputs: Sequence[tuple[int, ...]]) -> list[tuple[list[int], int]]:
    """Greedy groups of sorted neighbours: (datum indices, shared length)."""
    order = sorted(range(len(inputs)), key=lambda i: inputs[i])
    groups: list[tuple[list[int], int]] = []
    members, shared = [order[0]], len(inputs[order[0]]) - 1
    for i in order[1:]:
        common = _lcp(inputs[members[0]], inputs[i], min(shared, len(inputs[i]) - 1))
        if common >= MIN_SHARED:
            members, shared = members + [i], common
        else:
            groups.append((members, shared))
            members, shared = [i], len(inputs[i]) - 1
    groups.append((members, shared))
    return groups


def plan_prefixes(inputs: Sequence[tuple[int, ...]]) -> PrefixPlan | None:
    if len(inputs) < 2:
        return None
    prefixes, owner, shared = [], [0] * len(inputs), [0] * len(inputs)
    for members, n in _groups(inputs):
        if len(members) < 2 or n < MIN_SHARED:
            continue
        for i in members:
            owner[i], shared[i] = len(prefixes) + 1, n  # provisional (+1): 0 means none for now
        prefixes.append(tuple(inputs[members[0]][:n]))
    plain = sum(len(x) for x in inputs)
    saved = sum(shared) - sum(len(p) for p in prefixes)
    if not prefixes or saved < MIN_SAVING * plain:
        return None
    none = len(prefixes)
    return PrefixPlan(tuple(prefixes), tuple(o - 1 if o else none for o in owner), tuple(shared))


def _padded(seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
    lens = [len(s) for s in seqs]
    tokens = torch.zeros(len(seqs), max(lens), dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : lens[i]] = torch.tensor(s, dtype=torch.long)
    return tokens, lens


def shared_prefix_logsoftmax(model, inputs: Sequence[tuple[int, ...]], plan: PrefixPlan, adapters=None):
    """The log-softmax row of every input position, datums concatenated in order, via one forward
    of each shared prefix and one of the suffixes. `model` is an InvariantLM; returns (T, V).
    adapters: None, or the (prefix rows', suffix rows') AdapterAssignments of a packed batch
    (engine/packed.py: a prefix is shared only within one model's datums)."""
    from lockstep.engine.model import KVCache

    pre_tokens, _ = _padded(plan.prefixes)
    suf_tokens, suf_lens = _padded([x[n:] for x, n in zip(inputs, plan.shared)])
    P, Tp = pre_tokens.shape
    B, S = suf_tokens.shape
    capacity = max(plan.shared) + S
    cache = model.new_cache(P, capacity)
    pre_lora, suf_lora = adapters if adapters is not None else (None, None)
    pre_hidden = model.hidden_states(pre_tokens, torch.arange(Tp).expand(P, Tp), cache, adapters=pre_lora)
    empty = model.new_cache(1, capacity)  # row P: the datums with no shared prefix
    cache = KVCache([torch.cat([k, e]) for k, e in zip(cache.k, empty.k)],
                    [torch.cat([v, e]) for v, e in zip(cache.v1, empty.v1)])
    rows = cache.select(plan.owner)  # a prefix row's gradient sums its copies in a fixed order (rows.py)
    positions = torch.tensor(plan.shared).unsqueeze(1) + torch.arange(S)
    suf_hidden = model.hidden_states(suf_tokens, positions, rows, adapters=suf_lora)
    hidden = torch.cat([pre_hidden.reshape(P * Tp, -1), suf_hidden.reshape(B * S, -1)])
    index, head_rows = [], []
    for d, (n, o) in enumerate(zip(plan.shared, plan.owner)):
        index += range(o * Tp, o * Tp + n)
        index += range(P * Tp + d * S, P * Tp + d * S + suf_lens[d])
        if suf_lora is not None:  # datum d's logit rows are its model's (an lm_head adapter's rows)
            head_rows += [suf_lora.rows[d]] * (n + suf_lens[d])
    head = AdapterAssignment(suf_lora.adapters, tuple(head_rows)) if suf_lora is not None else None
    return model.log_softmax(model.logits(copy_rows(hidden, index), head))
