"""The one forward that both the sampler and the trainer run.

`InvariantLM` reads the parameters of a transformers Llama-family model (optionally with peft LoRA
layers injected) and computes the forward with the batch-invariant ops of `engine.invariant`. The
module tree stays the transformers one, so peft, safetensors export and `save_pretrained` work as
usual; only the arithmetic is ours. Gradients flow into the same parameters, so the trainer uses
this forward too and logprobs agree bit for bit with the sampler's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lockstep.engine import invariant as inv
from lockstep.engine.invariant import KEY_BLOCK, ROW_TILE, round_up


@dataclass
class KVCache:
    """Per-layer keys (B, Hkv, L, D) and values with a ones column (B, Hkv, L, D+1).

    Index j along L holds the token at position j of that row; unwritten slots are zero and are
    never visible because attention masks keys by position.
    """

    k: list[torch.Tensor]
    v1: list[torch.Tensor]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def select(self, rows: torch.Tensor) -> "KVCache":
        """A cache holding the given rows (used for prefix sharing and for compacting the batch)."""
        return KVCache([k.index_select(0, rows) for k in self.k], [v.index_select(0, rows) for v in self.v1])


def _lora_parts(module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """The active (A, B, scaling) triples of a peft LoRA layer, or [] for a plain Linear."""
    if not hasattr(module, "lora_A") or getattr(module, "disable_adapters", False):
        return []
    if getattr(module, "merged", False):
        return []
    parts = []
    for name in module.active_adapters:
        if name in module.lora_A:
            parts.append((module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]))
    return parts


def apply_linear(module, x: torch.Tensor) -> torch.Tensor:
    """A (possibly LoRA-wrapped) nn.Linear, computed row-invariantly; same order of ops as peft."""
    base = getattr(module, "base_layer", module)
    y = inv.linear(x, base.weight, base.bias)
    for a, b, scaling in _lora_parts(module):
        y = y + inv.linear(inv.linear(x, a), b) * scaling
    return y


class InvariantLM:
    """Batch-invariant forward over a transformers causal LM (Llama, Qwen2, Qwen3, Mistral)."""

    def __init__(self, hf_model):
        self.hf_model = hf_model  # a PreTrainedModel or a peft PeftModel around one
        causal = hf_model
        if hasattr(hf_model, "peft_config"):
            causal = hf_model.base_model.model
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
        self._inv_freq = rotary.inv_freq.detach().float().clone()
        self._rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._rope_table = (torch.empty(0, self.head_dim), torch.empty(0, self.head_dim))

    # -- tables and caches -------------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for the given positions, from a table that is only ever extended."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self._rope_table
        if cos.shape[0] < need:
            n = max(need, 2 * cos.shape[0], 256)
            freqs = torch.arange(n, dtype=torch.float32)[:, None] * self._inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_table = (emb.cos() * self._rope_scaling, emb.sin() * self._rope_scaling)
            cos, sin = self._rope_table
        return cos[positions], sin[positions]

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        L = round_up(max(capacity, 1), KEY_BLOCK)
        shape = (batch, self.num_kv_heads, L, self.head_dim)
        k = [torch.zeros(shape) for _ in self.inner.layers]
        v1 = []
        for _ in self.inner.layers:
            v = torch.zeros(batch, self.num_kv_heads, L, self.head_dim + 1)
            v[..., -1] = 1.0
            v1.append(v)
        return KVCache(k, v1)

    # -- the forward -------------------------------------------------------------------------
    def hidden_states(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states (B, T, hidden).

        Without a cache, row b is a sequence starting at position 0 (positions must be None).
        With a cache, token (b, t) is written to the cache at positions_BT[b, t] and attends to
        every cached position <= its own.
        """
        B, T = tokens_BT.shape
        if cache is None:
            assert positions_BT is None, "without a cache, sequences start at position 0"
            T_pad = round_up(T, KEY_BLOCK)
            if T_pad != T:
                tokens_BT = F.pad(tokens_BT, (0, T_pad - T))
            positions_BT = torch.arange(T_pad).expand(B, T_pad)
        cos, sin = self.rope(positions_BT)  # (B, T', D)
        x = F.embedding(tokens_BT, self.inner.embed_tokens.weight)
        kv_len = int(positions_BT.max()) + 1
        for i, layer in enumerate(self.inner.layers):
            h = inv.rms_norm(x, layer.input_layernorm.weight, self.eps)
            x = x + self._attention(layer.self_attn, h, positions_BT, cos, sin, cache, i, kv_len)
            h = inv.rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
            x = x + self._mlp(layer.mlp, h)
        x = inv.rms_norm(x, self.inner.norm.weight, self.eps)
        return x[:, :T]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return apply_linear(self.lm_head, hidden)

    def logprobs_of(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(target) for each hidden row; hidden (..., H), targets (...)."""
        lp = inv.log_softmax(self.logits(hidden))
        return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def _mlp(self, mlp, h: torch.Tensor) -> torch.Tensor:
        gate = inv.silu(apply_linear(mlp.gate_proj, h))
        return apply_linear(mlp.down_proj, gate * apply_linear(mlp.up_proj, h))

    def _attention(self, attn, h, positions_BT, cos, sin, cache, layer_idx, kv_len) -> torch.Tensor:
        B, T, _ = h.shape
        Hkv, G, D = self.num_kv_heads, self.group, self.head_dim
        q = apply_linear(attn.q_proj, h).view(B, T, Hkv, G, D)
        k = apply_linear(attn.k_proj, h).view(B, T, Hkv, D)
        v = apply_linear(attn.v_proj, h).view(B, T, Hkv, D)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q = inv.rms_norm(q, attn.q_norm.weight, self.eps)
            k = inv.rms_norm(k, attn.k_norm.weight, self.eps)
        q = inv.apply_rope(q, cos[:, :, None, None], sin[:, :, None, None])
        k = inv.apply_rope(k, cos[:, :, None], sin[:, :, None])
        if cache is None:
            keys = k.transpose(1, 2)
            values = torch.cat([v, v.new_ones(B, T, Hkv, 1)], dim=-1).transpose(1, 2)
        else:
            keys, values = cache.k[layer_idx], cache.v1[layer_idx]
            b_idx = torch.arange(B).unsqueeze(1).expand(B, T)
            keys[b_idx, :, positions_BT] = k
            values[b_idx, :, positions_BT, :D] = v
        # Query rows are (group head, position) per KV head, padded to ROW_TILE.
        rows = G * T
        R = round_up(rows, ROW_TILE)
        q_rows = q.permute(0, 2, 3, 1, 4).reshape(B, Hkv, rows, D)
        qpos = positions_BT.unsqueeze(1).expand(B, G, T).reshape(B, rows)
        if R != rows:
            q_rows = F.pad(q_rows, (0, 0, 0, R - rows))
            qpos = F.pad(qpos, (0, R - rows))
        num_blocks = -(-kv_len // KEY_BLOCK)
        out = inv.blocked_attention(q_rows, qpos, keys, values, num_blocks, self.scale)
        out = out[:, :, :rows].reshape(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hkv * G * D)
        return apply_linear(attn.o_proj, out)
