"""Many LoRA adapters over one frozen base in one forward: each row computes with its own adapter
and gets, bit for bit, what it gets alone.

How a packed batch flows through the forward (InvariantLM, every path):

* The rows of all tenants go through the base's products together. Those products are the
  batch-invariant ones of every forward here (a row's bits never depend on its neighbours, the
  number of rows or the threads), so sharing them costs no bit.
* After each projection group of a layer (q|k|v, o, gate|up, down), `RowLora.project` adds each
  row's own update. For adapter a, its rows are gathered in batch order and its factors applied
  through the path's row-invariant product: ((x_a A^T) B^T) * scaling, peft's computation on a batch
  of its own; then y[r] + delta[r] on those rows only (one rounding; a projection of the group
  that the adapter lacks adds +0, as peft's zero slice does). A row with no adapter keeps the
  base's bits. Each adapter works at its own rank: nothing is padded to a common rank, so no
  reduction's length depends on another tenant. On the fused CPU path one C++ call per group does
  every adapter (kernels/lora.cpp: the same fixed-plan gemm as `fused.linear`, so the same bits);
  the eager and Triton paths loop over the adapters with their own linear.
* Backward (`_RowLoraFn`): for each adapter, on its rows only, the gradients of that same local
  computation (autograd through the path's linear), so dA_a and dB_a are products over adapter a's
  rows in their batch order and nothing else: no split-K, no atomics, no other tenant's token.
  Which rows: `AdapterAssignment.tokens` limits an adapter to the first tokens of each row, so a
  packed trainer's padding past a tenant's own length runs on the bare base, and the gradient
  products cover exactly the rows the tenant has alone (engine/packed.py). The input's gradient
  gets one term per projection, in the order autograd added peft's (v, k, q), then the base's.
* The unembedding (`lm_head`, tied to the embeddings or not) is one more target, keyed
  (HEAD_LAYER, "lm_head"): `InvariantLM.logits` takes the call's assignment too and adds each
  row's `((h_a A^T) B^T) * scaling` (A: rank x hidden, B: vocab x rank) after the base's logits,
  through the same `project` (the fused kernel's table holds it as one more layer row), so the
  sampler's logits and the trainer's are the same bits, alone and packed; its dA, dB are products
  over the adapter's own logit rows, as for the other targets. A tied base's embedding is never
  touched (peft's lm_head LoRA adapts the output side only).
* A peft-wrapped model (a `Trainer` with `lora=`) goes through the same code, its adapter read from
  the peft layers and applied to every row (its lm_head adapter through `apply_linear`, peft's own
  computation on all rows): a LoRA trainer built the old way and an adapter on a shared base
  compute the same bits from the same weights.

A hostile adapter (huge or NaN weights) can only reach its own rows: nothing here mixes rows of
two adapters, and the base's products and attention never mix two rows' values.
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

import torch

from lockstep.engine.types import AdapterAssignment, AdapterWeights, EngineError, LoraFactors

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""A decoder layer's projections an adapter may target, in the order of kernels/stack.cpp's."""
HEAD = "lm_head"
HEAD_LAYER = -1
"""The unembedding's key in `AdapterWeights.factors`: (HEAD_LAYER, HEAD), after every layer."""
ADAPTABLE = TARGETS + (HEAD,)
"""Every target an adapter on a shared base may name."""
GROUPS = {"attn": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "mlp": ("gate_proj", "up_proj"),
          "down": ("down_proj",), "head": (HEAD,)}
"""The projections each product computes at once (a layer's four groups, and the logits)."""
_PROJ = {**{t: i for i, t in enumerate(TARGETS)}, HEAD: 0}
"""Each target's column in its row of the kernel's AdapterTable (lm_head: the one column of the
row after the layers')."""

_TABLES: "weakref.WeakKeyDictionary[AdapterWeights, object]" = weakref.WeakKeyDictionary()
"""Each adapter's kernels/lora.cpp AdapterTable (references to its tensors, so in-place optimizer
steps are seen), built once."""


def _table(adapter: AdapterWeights, num_layers: int):
    table = _TABLES.get(adapter)
    if table is None:
        from lockstep.engine import kernels

        layers = [[None] * len(TARGETS) for _ in range(num_layers)] + [[None]]  # the last row: lm_head
        for (layer, target), f in adapter.factors.items():
            layers[_table_row(layer, num_layers)][_PROJ[target]] = (f.a, f.b, float(f.scaling))
        table = _TABLES[adapter] = kernels.load().AdapterTable(layers)
    return table


def _table_row(layer: int, num_layers: int) -> int:
    return num_layers if layer == HEAD_LAYER else layer


class RowLora:
    """One forward call's per-row adapters, resolved once for all its layers."""

    def __init__(self, assignment: AdapterAssignment, batch: int, length: int, *, device, num_layers: int,
                 implicit: bool = False):
        if len(assignment.rows) != batch:
            raise EngineError(f"adapter rows: one per batch row ({batch}), got {len(assignment.rows)}")
        self.adapters = assignment.adapters
        self.num_layers = num_layers
        self.implicit = implicit
        """True for a peft model's own adapter on every row (the decoder stack holds it already)."""
        flat = torch.tensor(assignment.rows, dtype=torch.long).repeat_interleave(length)
        if assignment.tokens is not None:
            limit = torch.tensor(assignment.tokens, dtype=torch.long).repeat_interleave(length)
            flat = torch.where(torch.arange(length).repeat(batch) < limit, flat, -1)
        self.flat = flat
        """(batch * length,) int64 on the CPU: each flattened token row's adapter, -1 for none."""
        self.device = device
        self._members: list[tuple[int, torch.Tensor]] | None = None

    def members(self) -> list[tuple[int, torch.Tensor]]:
        """(adapter index, its flat rows ascending, on the device) for each adapter with rows."""
        if self._members is None:
            out = []
            for k in range(len(self.adapters)):
                idx = (self.flat == k).nonzero().squeeze(1)
                if idx.numel():
                    out.append((k, idx.to(self.device)))
            self._members = out
        return self._members

    def stack_args(self) -> tuple[list, torch.Tensor]:
        """The decoder stack's per-row adapter arguments (kernels/stack.cpp)."""
        return [_table(a, self.num_layers) for a in self.adapters], self.flat

    def project(self, layer: int, group: str, y: torch.Tensor, x: torch.Tensor, widths: Sequence[int],
                lin: Callable, fused_kernels: bool) -> torch.Tensor:
        """y (..., sum(widths)), the base's product of x (..., in) for the group's projections, plus
        each row's adapter update."""
        targets = GROUPS[group]
        active = []
        for k, idx in self.members():
            fs = [self.adapters[k].factors.get((layer, t)) for t in targets]
            if any(f is not None for f in fs):
                active.append((k, idx, fs))
        if not active:
            return y
        plan = _Plan(self, layer, targets, tuple(widths), lin, fused_kernels, active)
        y2, x2 = y.reshape(-1, y.shape[-1]), x.reshape(-1, x.shape[-1])
        params = [t for _, _, fs in active for f in fs if f is not None for t in (f.a, f.b)]
        if torch.is_grad_enabled() and (x2.requires_grad or any(p.requires_grad for p in params)):
            out = _RowLoraFn.apply(y2, plan, *([x2] * len(targets)), *params)
        else:
            out = plan.forward(y2, x2)
        return out.view(y.shape)


class _Plan:
    """One projection group's update in one call: the adapters with rows and factors there."""

    def __init__(self, rl: RowLora, layer: int, targets, widths, lin, fused_kernels: bool, active):
        self.rl, self.layer, self.targets, self.widths = rl, layer, targets, widths
        self.lin, self.fused_kernels, self.active = lin, fused_kernels, active

    def forward(self, y2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        if self.fused_kernels:
            from lockstep.engine import kernels

            tables, flat = self.rl.stack_args()
            return kernels.load().lora_add(y2, x2, flat, tables, _table_row(self.layer, self.rl.num_layers),
                                           [_PROJ[t] for t in self.targets], list(self.widths))
        out = y2.clone()
        for _, idx, fs in self.active:
            xk = x2.index_select(0, idx)
            parts = [self._delta(xk, f) if f is not None else xk.new_zeros(len(idx), w) for f, w in zip(fs, self.widths)]
            delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
            out.index_copy_(0, idx, y2.index_select(0, idx) + delta)
        return out

    def _delta(self, x: torch.Tensor, f: LoraFactors) -> torch.Tensor:
        return self.lin(self.lin(x, f.a), f.b) * f.scaling

    def backward(self, g: torch.Tensor, x2: torch.Tensor, need_x: bool, need_params: Sequence[bool]):
        """(d x per target, d params in forward order) from g = d out (M, N)."""
        dx: list[torch.Tensor | None] = [None] * len(self.targets)
        dparams: list[torch.Tensor | None] = []
        need = iter(need_params)
        for _, idx, fs in self.active:
            gk = g.index_select(0, idx)
            offset = 0
            for j, (f, w) in enumerate(zip(fs, self.widths)):
                if f is None:
                    offset += w
                    continue
                want = (need_x, next(need), next(need))
                grads = self._local_grads(x2.index_select(0, idx), f, gk[:, offset : offset + w], want)
                if grads[0] is not None:
                    if dx[j] is None:
                        dx[j] = x2.new_zeros(x2.shape)
                    dx[j].index_copy_(0, idx, grads[0])
                dparams += grads[1:]
                offset += w
        return dx, dparams

    def _local_grads(self, xk, f: LoraFactors, gk, want) -> list[torch.Tensor | None]:
        """Autograd of delta = ((xk A^T) B^T) * scaling on these rows alone: (d xk, d A, d B), None
        where not wanted."""
        leaves = [xk.detach(), f.a.detach(), f.b.detach()]
        with torch.enable_grad():
            for t, w in zip(leaves, want):
                t.requires_grad_(w)
            delta = self._delta(leaves[0], LoraFactors(leaves[1], leaves[2], f.scaling))
            asked = [t for t, w in zip(leaves, want) if w]
            got = iter(torch.autograd.grad(delta, asked, gk)) if asked else iter(())
        return [next(got) if w else None for w in want]


class _RowLoraFn(torch.autograd.Function):
    """y + each row's adapter update, differentiable in x and in every adapter's factors. x comes in
    once per target of the group, in reverse order, so that its gradient terms are added as
    autograd added peft's (the last projection's first)."""

    @staticmethod
    def forward(ctx, y2, plan: _Plan, *xs_and_params):
        x2 = xs_and_params[0]
        ctx.plan = plan
        ctx.save_for_backward(x2)
        return plan.forward(y2, x2)

    @staticmethod
    def backward(ctx, g):
        plan: _Plan = ctx.plan
        (x2,) = ctx.saved_tensors
        n = len(plan.targets)
        need_x = any(ctx.needs_input_grad[2 : 2 + n])
        dx, dparams = plan.backward(g.contiguous(), x2, need_x, ctx.needs_input_grad[2 + n :])
        return (g, None, *reversed(dx), *dparams)


def check_adapter(adapter: AdapterWeights, shapes: dict[tuple[int, str], tuple[int, int]], *, device, what: str) -> None:
    """An adapter fits a base whose projections have these (in, out) shapes: every factor's shape,
    dtype and device, and a finite scaling; EngineError naming the first misfit."""
    if not isinstance(adapter, AdapterWeights):
        raise EngineError(f"{what}: an adapter must be an AdapterWeights, got {type(adapter).__name__}")
    for key, f in adapter.factors.items():
        if key not in shapes:
            raise EngineError(f"{what} ({adapter.name!r}): {key} is not a projection of this base; it has layers "
                              f"0..{max(k[0] for k in shapes)} with targets {list(TARGETS)}, and "
                              f"{(HEAD_LAYER, HEAD)}")
        fan_in, fan_out = shapes[key]
        a, b = f.a, f.b
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.dim() != 2 or b.dim() != 2:
            raise EngineError(f"{what} ({adapter.name!r}): {key} factors must be 2-D tensors")
        r = a.shape[0]
        if a.shape != (r, fan_in) or b.shape != (fan_out, r) or not 1 <= r <= min(fan_in, fan_out):
            raise EngineError(f"{what} ({adapter.name!r}): {key} factors {tuple(a.shape)}, {tuple(b.shape)} do not fit "
                              f"a {fan_in} -> {fan_out} projection (A (rank, {fan_in}), B ({fan_out}, rank), "
                              f"1 <= rank <= {min(fan_in, fan_out)})")
        if a.dtype != torch.float32 or b.dtype != torch.float32 or not (_on(a, device) and _on(b, device)):
            raise EngineError(f"{what} ({adapter.name!r}): {key} factors must be float32 on {device}")
        if not a.is_contiguous() or not b.is_contiguous():
            raise EngineError(f"{what} ({adapter.name!r}): {key} factors must be contiguous")
        if isinstance(f.scaling, bool) or not isinstance(f.scaling, (int, float)):
            raise EngineError(f"{what} ({adapter.name!r}): {key} scaling must be a number")


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)
