"""Row copies whose gradient is summed in a fixed order, on every device.

The trainer's shared prefixes copy one KV-cache row to every datum that shares it (engine/prefix.py),
so the prefix row's gradient is a sum over those datums. `index_select`'s backward forms it with
`index_add_`, which on CUDA adds with atomics: the terms land in whatever order the GPU's threads
reach them, so one micro-batch's gradient can differ in its last bits from one run to the next, and
a data-parallel step is then not bit for bit one trainer (engine/data_parallel.py relies on each
micro-batch's gradient being the same bits wherever it is computed). Here the sum is made in rounds:
round j adds, to every row, the j-th of its copies in index order, through copies to distinct rows
(no atomics, no two writes to one place), so every row's gradient is ((0 + g_a) + g_b) + ..., the
order CPU `index_add_` uses, on any device.
"""

from __future__ import annotations

from typing import Sequence

import torch


def copy_rows(x: torch.Tensor, rows: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """x[rows] along dim 0 (rows may repeat); under autograd its gradient reaches x in a fixed
    order. Outside autograd (the sampler's batch compaction) it is `index_select`."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        index = rows if isinstance(rows, torch.Tensor) else torch.tensor(list(rows), dtype=torch.long)
        return x.index_select(0, index.to(x.device))
    rows = rows.tolist() if isinstance(rows, torch.Tensor) else [int(r) for r in rows]
    index = torch.tensor(rows, dtype=torch.long, device=x.device)
    return _CopyRows.apply(x, index, _rounds(rows, x.device))


def _rounds(rows: Sequence[int], device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination rows, source positions) per round: round j pairs each row that occurs more
    than j times with the position of its j-th occurrence. Destinations within a round differ."""
    seen: dict[int, int] = {}
    rounds: list[tuple[list[int], list[int]]] = []
    for position, row in enumerate(rows):
        j = seen.get(row, 0)
        seen[row] = j + 1
        if j == len(rounds):
            rounds.append(([], []))
        rounds[j][0].append(row)
        rounds[j][1].append(position)
    return [(torch.tensor(d, dtype=torch.long, device=device), torch.tensor(s, dtype=torch.long, device=device))
            for d, s in rounds]


class _CopyRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, rounds):
        ctx.rounds, ctx.num_rows = rounds, x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_zeros((ctx.num_rows, *grad.shape[1:]))
        for dest, src in ctx.rounds:
            out.index_copy_(0, dest, out.index_select(0, dest) + grad.index_select(0, src))
        return out, None, None
