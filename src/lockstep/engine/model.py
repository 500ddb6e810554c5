"""The one forward that both the sampler and the trainer run.

`InvariantLM` reads the parameters of a transformers Llama-family model (optionally with peft LoRA
layers injected) and computes the forward with the batch-invariant ops of `engine.invariant`. The
module tree stays the transformers one, so peft, safetensors export and `save_pretrained` work as
usual; only the arithmetic is ours. Gradients flow into the same parameters, so the trainer runs
this forward too and its logprobs equal the sampler's bit for bit.

Projections that read the same input are fused (q|k|v and gate|up), in both uses alike, so a
decode step makes 4 matmul calls per layer instead of 7. Outside autograd the fused weights are
cached and re-derived whenever a parameter's in-place version counter moves.

LoRA: a call may name an adapter per row (`adapters`, an AdapterAssignment: one frozen base serving
many tenants); each row then gets its own adapter's update after every product (engine/multi_lora.py),
the logits' too (`logits(hidden, adapters)`: an adapter's lm_head). A peft-wrapped model's own
adapter goes through the same code, on every row.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from lockstep.engine import invariant as inv
from lockstep.engine.device import CPU, Compute
from lockstep.engine.invariant import KEY_BLOCK, ROW_TILE, round_up
from lockstep.engine.multi_lora import GROUPS, HEAD, HEAD_LAYER, TARGETS, RowLora, check_adapter
from lockstep.engine.rows import copy_rows
from lockstep.engine.types import AdapterAssignment, AdapterWeights, EngineError, LoraFactors, LoraSpec


@dataclass
class KVCache:
    """Per-layer keys (B, Hkv, L, D) and values with a ones column (B, Hkv, L, D+1). On the fused
    path the keys are a transposed view (stored (B, Hkv, D, L)); on the Triton path the values
    have no ones column (B, Hkv, L, D), and both live on the model's device in its dtype.

    Slot j of row b holds the token at position j; unwritten slots are zero and never visible,
    because attention masks keys by position. L is a multiple of KEY_BLOCK.
    """

    k: list[torch.Tensor]
    v1: list[torch.Tensor]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def select(self, rows: "torch.Tensor | Sequence[int]") -> "KVCache":
        """A cache holding the given batch rows (prefix sharing, batch compaction), in the same
        layout. Under autograd (shared prefixes: a row copied to each datum that shares it) the
        copies' gradients are summed in a fixed order on every device (engine/rows.py)."""
        return KVCache([_select_rows(k, rows) for k in self.k], [copy_rows(v, rows) for v in self.v1])


def _select_rows(keys: torch.Tensor, rows) -> torch.Tensor:
    if keys.stride(-2) == 1 and keys.stride(-1) != 1:  # stored transposed (the fused path's cache)
        return copy_rows(keys.transpose(-1, -2), rows).transpose(-1, -2)
    return copy_rows(keys, rows)


def _lora_parts(module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """The active (A, B, scaling) triples of a peft LoRA layer, or [] for a plain Linear."""
    if not hasattr(module, "lora_A") or getattr(module, "disable_adapters", False):
        return []
    if getattr(module, "merged", False):
        return []
    return [
        (module.lora_A[n].weight, module.lora_B[n].weight, module.scaling[n])
        for n in module.active_adapters
        if n in module.lora_A
    ]


def _base(module):
    return getattr(module, "base_layer", module)


def lora_delta(module, x: torch.Tensor, linear=inv.linear) -> torch.Tensor | None:
    """Sum of the module's active LoRA updates for input x, or None without LoRA."""
    out = None
    for a, b, scaling in _lora_parts(module):
        d = linear(linear(x, a), b) * scaling
        out = d if out is None else out + d
    return out


def apply_linear(module, x: torch.Tensor, linear=inv.linear) -> torch.Tensor:
    """A (possibly LoRA-wrapped) nn.Linear, computed row-invariantly (`linear`: the path's matmul)."""
    base = _base(module)
    y = linear(x, base.weight, base.bias)
    d = lora_delta(module, x, linear)
    return y if d is None else y + d


def _fuse(modules) -> tuple[torch.Tensor, torch.Tensor | None]:
    bases = [_base(m) for m in modules]
    weight = torch.cat([b.weight for b in bases], dim=0)
    if all(b.bias is None for b in bases):
        return weight, None
    bias = torch.cat([b.bias if b.bias is not None else b.weight.new_zeros(b.weight.shape[0]) for b in bases])
    return weight, bias


class InvariantLM:
    """Batch-invariant forward over a transformers causal LM (Llama, Qwen2, Qwen3, Mistral)."""

    def __init__(self, hf_model, compute: Compute = CPU):
        self.hf_model = hf_model  # a PreTrainedModel or a peft PeftModel around one
        self.compute = compute
        """Device and compute dtype. Parameters stay float32 (the optimizer's master weights); in
        bfloat16 the forward computes with bf16 copies (cached outside autograd, cast inline under it)."""
        self.dtype = compute.torch_dtype
        causal = hf_model.base_model.model if hasattr(hf_model, "peft_config") else hf_model
        self.causal = causal
        self.config = causal.config
        self.inner = causal.model
        self.lm_head = causal.lm_head
        cfg = self.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.num_heads // self.num_kv_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.inner.layers[0].self_attn.scaling
        rotary = self.inner.rotary_emb
        self._inv_freq = rotary.inv_freq.detach().float().clone().to(compute.device)
        self._rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._rope_table = (torch.empty(0, self.head_dim), torch.empty(0, self.head_dim))
        self._fused_cache: dict[str, tuple] = {}
        self._param_dicts = [m._parameters for m in hf_model.modules() if m._parameters]
        """Every module's parameter dict (the modules never change; their parameters may)."""
        self._lora_modules = [m for m in hf_model.modules() if hasattr(m, "lora_A")]
        self._stamp: tuple | None = None
        self._stack = None
        """The C++ decoder stack (kernels/stack.cpp) over the current weights, for forwards outside
        autograd on the fused path; None for a mixture-of-experts model or on the eager path."""
        self._plan = [_LayerPlan.of(layer) for layer in self.inner.layers]
        """Each layer's modules, looked up once: nn.Module attribute access costs ~1 us, some 300
        times per decode step otherwise."""
        self._widths = [_group_widths(lp) for lp in self._plan]
        """Each layer's projection groups' output sizes (engine/multi_lora.py GROUPS)."""
        self._peft_adapter: tuple[tuple, AdapterWeights] | None = None
        self._checked: "weakref.WeakSet[AdapterWeights]" = weakref.WeakSet()
        """Adapters already checked against this base's shapes."""
        self._router_counts: dict[int, torch.Tensor] | None = None
        """Tokens (x top-k slots) each expert took, per MoE layer, since reset_router_counts(); None
        (not counted) until a trainer asks."""
        self.routing: RoutingLog | None = None
        """Set to a RoutingLog to record every MoE layer's expert choices (tests, consistency)."""
        self.path, self.path_reason = _choose_path(self)
        """"fused" (the C++ kernels, engine/fused.py), "triton" (engine/triton_ops.py: CUDA, or the
        interpreter in tests) or "eager" (pure PyTorch), and why."""
        self.ops = _path_ops(self.path)
        """The path's differentiable kernels (engine/fused.py or engine/triton_ops.py), None on eager."""
        self._casts: dict = {}
        """Triton path in bfloat16, outside autograd: each float32 weight's bf16 copy."""

    # -- tables, fused weights, caches ---------------------------------------------------------
    def rope(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for the given positions, from a table that is only ever extended."""
        need = max_position + 1
        cos, sin = self._rope_table
        if cos.shape[0] < need:
            n = max(need, 2 * cos.shape[0], 256)
            freqs = torch.arange(n, dtype=torch.float32, device=self._inv_freq.device)[:, None] * self._inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_table = (emb.cos() * self._rope_scaling, emb.sin() * self._rope_scaling)
            cos, sin = self._rope_table
        return cos[positions], sin[positions]

    def _fused_groups(self):
        for i, layer in enumerate(self.inner.layers):
            yield f"attn{i}", (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
            if not _is_moe(layer.mlp):
                yield f"mlp{i}", (layer.mlp.gate_proj, layer.mlp.up_proj)

    def _weights_stamp(self) -> tuple:
        """What the derived weights depend on: each parameter's identity, in-place version counter
        (it moves on every optimizer step or copy_) and data pointer (it moves on every `.data`
        swap, the generator's zero-copy hot-swap), and each LoRA layer's adapter state."""
        params = tuple((id(p), p._version, p.data_ptr()) for ps in self._param_dicts for p in ps.values() if p is not None)
        adapters = tuple((getattr(m, "disable_adapters", False), getattr(m, "merged", False), tuple(m.active_adapters))
                         for m in self._lora_modules)
        return params, adapters

    def _refresh_derived(self) -> None:
        """Outside autograd, (re)build the fused weights and the decoder stack once per forward if
        any weight moved, so a stale copy is impossible without anyone invalidating it by hand."""
        stamp = self._weights_stamp()
        if self._stamp != stamp:
            self._fused_cache = {key: (self._compute_copy(w.detach()), b.detach() if b is not None else None)
                                 for key, (w, b) in ((key, _fuse(mods)) for key, mods in self._fused_groups())}
            self._casts = {id(p): (p, self._compute_copy(p.detach())) for ps in self._param_dicts
                           for p in ps.values() if p is not None and p.dim() >= 2} if self._casting else {}
            self._stack = self._build_stack() if self.path == "fused" else None
            self._stamp = stamp

    @property
    def _casting(self) -> bool:
        """Whether weights are cast for the forward (bf16 compute over float32 parameters)."""
        return self.path == "triton" and self.dtype != torch.float32

    def _compute_copy(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(self.dtype) if self._casting else weight

    def _weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight as the forward computes with it: in bf16 a float32 parameter's bf16 copy (cached
        outside autograd; under it cast inline, so gradients reach the float32 parameter)."""
        if not self._casting or weight.dtype == self.dtype:
            return weight
        cached = None if torch.is_grad_enabled() else self._casts.get(id(weight))
        return cached[1] if cached is not None and cached[0] is weight else weight.to(self.dtype)

    def _lin(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The path's row-invariant matmul (a bias is added in float32 by the kernel)."""
        weight = self._weight(weight)
        return self.ops.linear(x, weight, bias) if self.ops is not None else inv.linear(x, weight, bias)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row-wise float32 log-softmax on this model's path: the one sampler and trainer share."""
        return self.ops.log_softmax(logits) if self.ops is not None else inv.log_softmax(logits)

    def _build_stack(self):
        """kernels/stack.cpp's DecoderStack over the current weights (None for a mixture of experts,
        whose layers only the per-op path runs)."""
        from lockstep.engine import kernels

        if any(lp.moe is not None for lp in self._plan):
            return None
        layers, lora_ab, lora_scale = [], [], []
        for i, lp in enumerate(self._plan):
            (qkv_w, qkv_b), (gu_w, gu_b) = self._fused_cache[f"attn{i}"], self._fused_cache[f"mlp{i}"]
            o, down, qk = _base(lp.o_proj), _base(lp.down), lp.qk_norms
            tensors = [lp.in_norm["weight"], qkv_w, qkv_b, qk and qk[0]["weight"], qk and qk[1]["weight"],
                       o.weight, o.bias, lp.post_norm["weight"], gu_w, gu_b, down.weight, down.bias]
            layers.append([t.detach() if t is not None else None for t in tensors])
            parts = [_lora_parts(m) for m in lp.projections]
            lora_ab.append([[t.detach() for a, b, _ in ps for t in (a, b)] for ps in parts])
            lora_scale.append([[float(s) for _, _, s in ps] for ps in parts])
        out_features = [_base(m).weight.shape[0] for m in self._plan[0].projections]
        return kernels.load().DecoderStack(layers, lora_ab, lora_scale, out_features, self.inner.norm.weight.detach(),
                                           self.eps, self.scale, self.num_heads, self.num_kv_heads, self.head_dim)

    def fused(self, key: str, modules) -> tuple[torch.Tensor, torch.Tensor | None]:
        if torch.is_grad_enabled():
            return _fuse(modules)  # differentiable: gradients flow back into each projection
        return self._fused_cache[key]

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        shape = (batch, self.num_kv_heads, round_up(max(capacity, 1), KEY_BLOCK), self.head_dim)
        if self.path == "triton":  # the Triton attention ignores a ones column: none is stored
            like = {"device": self.compute.device, "dtype": self.dtype}
            return KVCache([torch.zeros(shape, **like) for _ in self.inner.layers],
                           [torch.zeros(shape, **like) for _ in self.inner.layers])
        if self.path == "fused":  # keys stored transposed, (B, H, D, L) in memory: the fused attention
            # reads a decode step's keys in place, a block of key positions per vector
            k = [torch.zeros(*shape[:2], shape[3], shape[2]).transpose(2, 3) for _ in self.inner.layers]
        else:
            k = [torch.zeros(shape) for _ in self.inner.layers]
        v1 = []
        for _ in self.inner.layers:
            v = torch.zeros(*shape[:-1], self.head_dim + 1)
            v[..., -1] = 1.0
            v1.append(v)
        return KVCache(k, v1)

    # -- the forward -------------------------------------------------------------------------
    def hidden_states(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        cache: KVCache | None = None,
        adapters: AdapterAssignment | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states (B, T, hidden).

        Without a cache, row b is a sequence starting at position 0 (positions must be None).
        With a cache, token (b, t) is written to the cache at positions_BT[b, t] and attends to
        every cached position <= its own. `adapters`: the LoRA adapter of each row (a shared base's
        tenants), or None (a peft model's own adapter, or the bare base).
        """
        B, T = tokens_BT.shape
        if cache is None:
            assert positions_BT is None, "without a cache, sequences start at position 0"
            positions_BT = torch.arange(T).expand(B, T)
        if self.routing is not None:
            self.routing.start_call()
        rl = self._row_lora(adapters, B, T)
        if self.path != "eager":
            device = self.compute.device
            return self._hidden_fused(tokens_BT.to(device), positions_BT.to(device), cache, rl)
        max_position = int(positions_BT.max())  # one sync per forward, shared by rope and the mask
        cos, sin = self.rope(positions_BT, max_position)  # (B, T, D)
        kv_len = round_up(max_position + 1, KEY_BLOCK)
        ctx = _AttnContext.build(positions_BT, self.group, kv_len, cos, sin, cache)
        if not torch.is_grad_enabled():
            self._refresh_derived()
        x = F.embedding(tokens_BT, self.inner.embed_tokens.weight)
        for i, layer in enumerate(self.inner.layers):
            h = inv.rms_norm(x, layer.input_layernorm.weight, self.eps)
            x = x + self._attention(i, layer.self_attn, h, ctx, rl)
            h = inv.rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
            x = x + self._mlp(i, layer.mlp, h, rl)
        return inv.rms_norm(x, self.inner.norm.weight, self.eps)

    # -- per-row LoRA --------------------------------------------------------------------------
    def _row_lora(self, adapters: AdapterAssignment | None, batch: int, length: int) -> RowLora | None:
        """The call's per-row adapters: the assignment's, else a peft model's own on every row."""
        peft = self._peft_own_adapter()
        if adapters is None:
            if peft is None:
                return None
            adapters, implicit = AdapterAssignment((peft,), (0,) * batch), True
        else:
            for a in adapters.adapters:
                self.check_adapter(a)
            implicit = False
        return RowLora(adapters, batch, length, device=self.compute.device, num_layers=len(self._plan),
                       implicit=implicit)

    def check_adapter(self, adapter: AdapterWeights, what: str = "adapter") -> None:
        """EngineError unless the adapter fits this base (checked once per adapter object)."""
        if adapter in self._checked if isinstance(adapter, AdapterWeights) else False:
            return
        if self._lora_modules:
            raise EngineError("this model carries its own LoRA adapter (peft); per-row adapters need a bare base")
        check_adapter(adapter, self.projection_shapes(), device=torch.device(self.compute.device), what=what)
        self._checked.add(adapter)

    def projection_shapes(self) -> dict[tuple[int, str], tuple[int, int]]:
        """(layer, target) -> (in, out) of every projection an adapter may target (dense layers),
        and (HEAD_LAYER, "lm_head") -> (hidden, vocab), the unembedding."""
        out = {}
        for i, lp in enumerate(self._plan):
            if lp.moe is None:
                for t, m in zip(TARGETS, lp.projections):
                    out[(i, t)] = (_base(m).weight.shape[1], _base(m).weight.shape[0])
        head = _base(self.lm_head).weight
        out[(HEAD_LAYER, HEAD)] = (head.shape[1], head.shape[0])
        return out

    def _peft_own_adapter(self) -> AdapterWeights | None:
        """A peft model's active adapter as an AdapterWeights over its very parameters (rebuilt when
        a layer's adapter state or a parameter object changes), or None."""
        if not self._lora_modules:
            return None
        parts = {}
        for i, lp in enumerate(self._plan):
            if lp.moe is not None:
                continue
            for t, m in zip(TARGETS, lp.projections):
                found = _lora_parts(m)
                if len(found) > 1:
                    raise EngineError(f"layer {i} {t} has {len(found)} active LoRA adapters; lockstep runs one")
                if found:
                    parts[(i, t)] = found[0]
        if not parts:
            return None
        key = tuple((k, id(a), id(b), s) for k, (a, b, s) in parts.items())
        if self._peft_adapter is None or self._peft_adapter[0] != key:
            (_, _, s0), rank = next(iter(parts.values())), next(iter(parts.values()))[0].shape[0]
            spec = LoraSpec(rank=rank, alpha=float(s0) * rank, target_modules=tuple(sorted({t for _, t in parts})))
            factors = {k: LoraFactors(a, b, float(s)) for k, (a, b, s) in parts.items()}
            self._peft_adapter = (key, AdapterWeights("peft", 0, spec, factors))
        return self._peft_adapter[1]

    def _project(self, i: int, group: str, modules, x: torch.Tensor, rl: RowLora | None, fused=None) -> torch.Tensor:
        """The group's base product of x (one fused matmul for several projections), plus each row's
        LoRA update."""
        if fused is None:
            base = _base(modules[0])
            fused = (base.weight, base.bias)
        y = self._lin(x, *fused)
        if rl is None:
            return y
        return rl.project(i, group, y, x, self._widths[i][group], self._lin, self.path == "fused")

    def _hidden_fused(self, tokens_BT, positions_BT, cache: KVCache | None, rl: RowLora | None) -> torch.Tensor:
        """hidden_states on the fused kernels (C++ on CPU, or Triton): per layer one norm (fused
        with the residual add), the q|k|v and gate|up matmuls, one rope, one attention, one SiLU*up
        and two more matmuls. Outside autograd a dense model on the C++ kernels runs all its layers
        in one call (kernels/stack.cpp), which composes the same kernels in the same order."""
        fused = self.ops

        cos, sin = self.rope(positions_BT, int(positions_BT.max()))
        cos, sin = inv.rope_tables(cos, sin)
        x = F.embedding(tokens_BT, self.inner.embed_tokens.weight).to(self.dtype)
        if not torch.is_grad_enabled():
            self._refresh_derived()
            if self._stack is not None:  # every layer in one call: the same kernels, the same bits
                tables, rows = rl.stack_args() if rl is not None and not rl.implicit else ([], _NO_ROWS)
                return self._stack.forward(x, positions_BT, cos, sin, cache.k if cache else [], cache.v1 if cache else [],
                                           tables, rows)
        plan = self._plan
        h = fused.rms_norm(x, plan[0].in_norm["weight"], self.eps)
        for i, lp in enumerate(plan):
            a = self._attention_fused(i, lp, h, positions_BT, cos, sin, cache, rl)
            x, h = fused.add_rms_norm(x, a, lp.post_norm["weight"], self.eps)
            if lp.moe is not None:
                m = self._moe(i, lp.moe, h, fused.silu_mul)
            else:
                gate_up = self._project(i, "mlp", lp.mlp, h, rl, self.fused(f"mlp{i}", lp.mlp))
                m = self._project(i, "down", (lp.down,), fused.silu_mul(gate_up), rl)
            norm = plan[i + 1].in_norm if i + 1 < len(plan) else self.inner.norm._parameters
            x, h = fused.add_rms_norm(x, m, norm["weight"], self.eps)
        return h

    def _attention_fused(self, i: int, lp: "_LayerPlan", h, positions_BT, cos, sin, cache: KVCache | None,
                         rl: RowLora | None) -> torch.Tensor:
        fused = self.ops
        B, T, _ = h.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._project(i, "attn", lp.attn, h, rl, self.fused(f"attn{i}", lp.attn)).view(B, T, Hq + 2 * Hkv, D)
        qk, v = qkv[:, :, : Hq + Hkv], qkv[:, :, Hq + Hkv :]
        if lp.qk_norms is not None:  # Qwen3: per-head RMSNorm before RoPE
            qk = torch.cat([fused.rms_norm(qk[:, :, :Hq], lp.qk_norms[0]["weight"], self.eps),
                            fused.rms_norm(qk[:, :, Hq:], lp.qk_norms[1]["weight"], self.eps)], dim=2)
        qk = fused.rope(qk, cos, sin)
        q, k = qk[:, :, :Hq], qk[:, :, Hq:]
        if cache is None:  # the fresh projections are the keys: query t sees keys 0..t
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
        else:
            keys, values = cache.k[i], cache.v1[i]
            fused.cache_write(keys, values, k, v, positions_BT)
        out = fused.attention(q, keys, values, positions_BT, self.scale)
        return self._project(i, "o", (lp.o_proj,), out.reshape(B, T, Hq * D), rl)

    def _moe(self, i: int, block, h: torch.Tensor, silu_mul) -> torch.Tensor:
        """A sparse mixture-of-experts block (Qwen3-MoE, Mixtral) from invariant pieces.

        The router's logits come from a row-invariant product and its softmax and top-k are
        row-wise, so a token picks the same experts in a decode step and in a training forward:
        no routing replay is needed. Each expert runs on the rows routed to it (a row's result
        does not depend on which others share the expert's batch), and a token's expert outputs
        are summed in the order of its top-k slots, whatever the experts' order.
        """
        B, T, H = h.shape
        x = h.reshape(B * T, H)
        gate, experts = block.gate, block.experts
        k = gate.top_k
        probs = torch.exp(self.log_softmax(self._lin(x, gate.weight)))
        weights, chosen = torch.topk(probs, k, dim=-1)
        if getattr(gate, "norm_topk_prob", True):  # Mixtral always normalises; Qwen3-MoE by config
            weights = weights / weights.sum(-1, keepdim=True)
        if self.routing is not None:
            self.routing.record(i, chosen.detach().view(B, T, k))
        if self._router_counts is not None:
            counts = torch.bincount(chosen.detach().flatten(), minlength=probs.shape[-1])
            self._router_counts[i] = self._router_counts[i] + counts if i in self._router_counts else counts
        out_NKH = x.new_zeros(B * T, k, H)
        gate_up, down = self._weight(experts.gate_up_proj), self._weight(experts.down_proj)  # (E, ...), cast once
        for e in torch.unique(chosen).tolist():  # ascending: a fixed order, though nothing depends on it
            token, slot = (chosen == e).nonzero(as_tuple=True)
            act = silu_mul(self._lin(x.index_select(0, token), gate_up[e]))
            out_NKH = out_NKH.index_put((token, slot), self._lin(act, down[e]))
        y = out_NKH[:, 0] * weights[:, :1]
        for j in range(1, k):
            y = y + out_NKH[:, j] * weights[:, j : j + 1]
        return y.view(B, T, H).to(h.dtype)  # the routing weights are fp32; bf16 activations stay bf16

    def reset_router_counts(self) -> None:
        """Count the experts' tokens from zero (the sampler never asks, so never counts)."""
        self._router_counts = {}

    def router_metrics(self) -> dict[str, float]:
        """Load balance of each MoE layer's router since reset_router_counts() (padding rows included):
        `router/l<i>_max_load:max` is the busiest expert's share over a perfectly even share (1.0 =
        balanced), `router/l<i>_experts_used:max` how many experts took any token."""
        out = {}
        for i, counts in sorted((self._router_counts or {}).items()):
            even = counts.sum().item() / counts.numel()
            out[f"router/l{i}_max_load:max"] = counts.max().item() / even if even else 0.0
            out[f"router/l{i}_experts_used:max"] = float((counts > 0).sum().item())
        return out

    def logits(self, hidden: torch.Tensor, adapters: AdapterAssignment | None = None) -> torch.Tensor:
        """Logits (..., V) of hidden (B, ..., H). adapters: each of the B rows' adapter (its rows
        and token limits as in `hidden_states`, over the flattened middle dims), whose lm_head
        update is added to that row's logits; None: a peft model's own lm_head adapter, or none."""
        if adapters is None or not any((HEAD_LAYER, HEAD) in a.factors for a in adapters.adapters):
            return apply_linear(self.lm_head, hidden, self._lin)  # no row has an lm_head update
        length = hidden[0].numel() // hidden.shape[-1] if hidden.shape[0] else 1
        rl = self._row_lora(adapters, hidden.shape[0], length)
        head = _base(self.lm_head)
        y = self._lin(hidden, head.weight, head.bias)
        return rl.project(HEAD_LAYER, "head", y, hidden, (head.weight.shape[0],), self._lin, self.path == "fused")

    def logprobs_of(self, hidden: torch.Tensor, targets: torch.Tensor,
                    adapters: AdapterAssignment | None = None) -> torch.Tensor:
        """log p(target) for each hidden row; hidden (..., H), targets (...)."""
        return self.logprobs_and_entropy(hidden, targets, adapters)[0]

    def logprobs_and_entropy(self, hidden: torch.Tensor, targets: torch.Tensor,
                             adapters: AdapterAssignment | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(target) and the entropy of the next-token distribution (no gradient) per row."""
        lp = self.log_softmax(self.logits(hidden, adapters))
        with torch.no_grad():
            entropy = -(lp.exp() * lp).sum(-1)
        return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy

    def _mlp(self, i: int, mlp, h: torch.Tensor, rl: RowLora | None) -> torch.Tensor:
        if _is_moe(mlp):
            return self._moe(i, mlp, h, _eager_silu_mul)
        mods = (mlp.gate_proj, mlp.up_proj)
        gate, up = self._project(i, "mlp", mods, h, rl, self.fused(f"mlp{i}", mods)).chunk(2, dim=-1)
        return self._project(i, "down", (mlp.down_proj,), inv.silu(gate) * up, rl)

    def _attention(self, i: int, attn, h: torch.Tensor, ctx: "_AttnContext", rl: RowLora | None) -> torch.Tensor:
        B, T, _ = h.shape
        Hq, Hkv, G, D = self.num_heads, self.num_kv_heads, self.group, self.head_dim
        mods = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv = self._project(i, "attn", mods, h, rl, self.fused(f"attn{i}", mods)).view(B, T, Hq + 2 * Hkv, D)
        qk, v = qkv[:, :, : Hq + Hkv], qkv[:, :, Hq + Hkv :]
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            qk = torch.cat(
                [inv.rms_norm(qk[:, :, :Hq], attn.q_norm.weight, self.eps),
                 inv.rms_norm(qk[:, :, Hq:], attn.k_norm.weight, self.eps)], dim=2,
            )
        qk = inv.apply_rope(qk, ctx.cos, ctx.sin)
        q, k = qk[:, :, :Hq] * self.scale, qk[:, :, Hq:]
        keys, values = ctx.keys_values(i, k, v)
        # Query rows per KV head: (group head, position), padded to ROW_TILE.
        q_rows = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
        if ctx.rows_padded != G * T:
            q_rows = F.pad(q_rows, (0, 0, 0, ctx.rows_padded - G * T))
        out = inv.attention(q_rows, keys, values, ctx.bias)[:, :, : G * T]
        out = out.reshape(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq * D)
        return self._project(i, "o", (attn.o_proj,), out, rl)


@dataclass(frozen=True)
class _LayerPlan:
    """One decoder layer's modules, and its norms' parameter dicts (read at each use: a hot-swap
    may replace a parameter)."""

    in_norm: dict
    post_norm: dict
    attn: tuple  # q, k, v projections
    o_proj: object
    qk_norms: tuple | None  # Qwen3's per-head q and k norms
    mlp: tuple | None  # gate, up projections (a dense MLP)
    down: object
    moe: object | None  # the sparse MoE block instead

    @property
    def projections(self) -> tuple:
        """q, k, v, o, gate, up, down: the order of kernels/stack.cpp's LoRA lists."""
        return (*self.attn, self.o_proj, *self.mlp, self.down)

    @staticmethod
    def of(layer) -> "_LayerPlan":
        a, m = layer.self_attn, layer.mlp
        norms = (a.q_norm._parameters, a.k_norm._parameters) if hasattr(a, "q_norm") else None
        head = (layer.input_layernorm._parameters, layer.post_attention_layernorm._parameters,
                (a.q_proj, a.k_proj, a.v_proj), a.o_proj, norms)
        if _is_moe(m):
            return _LayerPlan(*head, None, None, m)
        return _LayerPlan(*head, (m.gate_proj, m.up_proj), m.down_proj, None)


_NO_ROWS = torch.empty(0, dtype=torch.long)


def _group_widths(lp: _LayerPlan) -> dict[str, tuple[int, ...]]:
    if lp.moe is not None:
        return {}
    mods = dict(zip(TARGETS, lp.projections))
    return {g: tuple(_base(mods[t]).weight.shape[0] for t in ts) for g, ts in GROUPS.items() if g != "head"}


def _is_moe(mlp) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def _eager_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return inv.silu(gate) * up


class RoutingLog:
    """The experts each token was routed to, per MoE layer, over the forwards while it is set
    (`InvariantLM.routing`): (B, T, k) tensors per call, in call order."""

    def __init__(self):
        self.calls: list[dict[int, torch.Tensor]] = []
        self._open: dict[int, torch.Tensor] | None = None

    def start_call(self) -> None:
        self._open = {}
        self.calls.append(self._open)

    def record(self, layer: int, chosen_BTK: torch.Tensor) -> None:
        if self._open is None:
            self.start_call()
        self._open[layer] = chosen_BTK.clone()


def _choose_path(model: "InvariantLM") -> tuple[str, str]:
    from lockstep.engine import kernels

    if model.compute.triton:
        model.compute.check()
        if model.head_dim % 2:
            raise EngineError(f"head size {model.head_dim} is odd: the Triton rotary kernel needs an even one "
                              "(run this model on model.device = 'cpu')")
        where = "CUDA" if model.compute.device == "cuda" else "CPU, under Triton's interpreter"
        return "triton", f"Triton kernels on {where}, {model.compute.dtype}"
    if kernels.load() is None:
        return "eager", "the fused kernels are not built" if os.environ.get(kernels.MODE_ENV) != "eager" else \
            f"{kernels.MODE_ENV}=eager"
    if model.head_dim % 2:
        return "eager", f"head size {model.head_dim} is odd (rotary embeddings need an even one)"
    return "fused", "fused CPU kernels"


def _path_ops(path: str):
    if path == "fused":
        from lockstep.engine import fused

        return fused
    if path == "triton":
        from lockstep.engine import triton_ops

        return triton_ops
    return None


@dataclass
class _AttnContext:
    """What every layer's attention shares in one forward: rope rows, mask, cache addressing."""

    cos: torch.Tensor  # (B, T, 1, D)
    sin: torch.Tensor
    bias: torch.Tensor  # (B, 1, R, L): 0 where a key is visible to a query row, -inf elsewhere
    rows_padded: int
    kv_len: int
    cache: KVCache | None
    write_at: tuple[torch.Tensor, torch.Tensor] | None  # batch and slot indices (B, T)

    @staticmethod
    def build(positions_BT, group, kv_len, cos, sin, cache) -> "_AttnContext":
        B, T = positions_BT.shape
        R = round_up(group * T, ROW_TILE)
        qpos = positions_BT.unsqueeze(1).expand(B, group, T).reshape(B, group * T)
        qpos = F.pad(qpos, (0, R - group * T))  # padded rows sit at position 0: key 0 is visible
        hidden = torch.arange(kv_len).view(1, 1, 1, kv_len) > qpos.view(B, 1, R, 1)
        bias = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
        write_at = None
        if cache is not None:
            write_at = (torch.arange(B).unsqueeze(1).expand(B, T), positions_BT)
        cos, sin = inv.rope_tables(cos.unsqueeze(2), sin.unsqueeze(2))
        return _AttnContext(cos, sin, bias, R, kv_len, cache, write_at)

    def keys_values(self, layer: int, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor):
        """Keys (B, H, L, D) and ones-augmented values (B, H, L, D+1) to attend over."""
        if self.cache is None:  # keys padded to kv_len with zeros, which the bias hides
            pad = self.kv_len - k_BTHD.shape[1]
            v1 = torch.cat([v_BTHD, v_BTHD.new_ones(*v_BTHD.shape[:-1], 1)], dim=-1)
            return (F.pad(k_BTHD, (0, 0, 0, 0, 0, pad)).transpose(1, 2),
                    F.pad(v1, (0, 0, 0, 0, 0, pad)).transpose(1, 2))
        b_idx, slot = self.write_at
        ck, cv = self.cache.k[layer], self.cache.v1[layer]
        ck[b_idx, :, slot] = k_BTHD
        cv[b_idx, :, slot, :-1] = v_BTHD
        return ck[:, :, : self.kv_len], cv[:, :, : self.kv_len]
