"""The Triton kernels (engine/triton_kernels.py) as differentiable ops, with engine/fused.py's API.

Outside autograd each op is one kernel call. Under autograd the forward is the same kernel, so the
trainer's logprobs are the sampler's bit for bit; the backward is the textbook gradient, from
torch ops in fp32 or (linear) from the same matmul kernel on transposed views. Gradients are
compared with torch autograd of a reference to a tolerance, not bitwise: nothing consumes them bit
for bit. Each gradient is returned in its input's dtype.
"""

from __future__ import annotations

import torch

from lockstep.engine import triton_kernels as K

# Query positions per chunk of attention's backward: its fp32 temporaries are
# (chunk, Hq, L) per batch row, so they stay near _ATTENTION_BACKWARD_ELEMENTS elements.
_ATTENTION_BACKWARD_ELEMENTS = 1 << 26


def _rms_norm_backward(dy, x, weight, rstd, need_weight_grad):
    """(dx, dweight or None) of y = weight * x * rstd, in fp32, returned in x's and weight's dtypes."""
    r = rstd.view(*x.shape[:-1], 1)
    xhat = x.float() * r
    g = dy.float() * weight.float()
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy.float() * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype) if need_weight_grad else None
    return dx, dw


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = K.rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _rms_norm_backward(dy, x, weight, rstd, ctx.needs_input_grad[1])
        return dx.to(x.dtype), dw, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, delta, weight, eps):
        s, y, rstd = K.add_rms_norm(x, delta, weight, eps)
        ctx.save_for_backward(s, weight, rstd)
        return s, y

    @staticmethod
    def backward(ctx, ds, dy):
        s, weight, rstd = ctx.saved_tensors
        dx, dw = _rms_norm_backward(dy, s, weight, rstd, ctx.needs_input_grad[2])
        d_sum = (dx + ds.float()).to(s.dtype)  # s = x + delta: both get the same gradient
        return d_sum, d_sum, dw, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return K.silu_mul(gate_up)

    @staticmethod
    def backward(ctx, dy):
        # For s = 1 / (1 + exp(-g)): d gate = dy * u * s * (1 + g * (1 - s)), d up = dy * g * s.
        (gate_up,) = ctx.saved_tensors
        g, u = gate_up.float().chunk(2, dim=-1)
        d = dy.float()
        s = torch.sigmoid(g)
        return torch.cat((d * u * s * (1 + g * (1 - s)), d * g * s), dim=-1).to(gate_up.dtype)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, signed_sin):
        ctx.save_for_backward(cos, signed_sin)
        ctx.dtype = x.dtype
        return K.rope(x, cos, signed_sin)

    @staticmethod
    def backward(ctx, dy):
        # y = x * c + roll(x, D/2) * s, so dx = dy * c + roll(dy * s, D/2) (a rotation's transpose).
        cos, signed_sin = (t.float().unsqueeze(2) for t in ctx.saved_tensors)
        d = dy.float()
        return (d * cos + torch.roll(d * signed_sin, d.shape[-1] // 2, dims=-1)).to(ctx.dtype), None, None


def _attention_backward(d_out, q, keys, values, positions, out, lse, scale):
    """(dq, d_keys, d_values) of attention, in fp32 from torch ops, a chunk of query positions at a
    time (the probabilities are rebuilt from lse)."""
    B, T, Hq, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    k = keys.float().repeat_interleave(G, dim=1)  # (B, Hq, L, D)
    v = values[..., :D].float().repeat_interleave(G, dim=1)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    chunk = max(1, _ATTENTION_BACKWARD_ELEMENTS // max(1, B * Hq * L))
    key_index = torch.arange(L, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        qc, doc = q[:, t0:t1].float(), d_out[:, t0:t1].float()
        hidden = (key_index.view(1, 1, 1, L) > positions[:, t0:t1, None, None])  # (B, t, 1, L)
        s = torch.einsum("bthd,bhld->bthl", qc, k) * scale
        p = torch.exp(s - lse[:, t0:t1, :, None]).masked_fill(hidden, 0.0)
        dv += torch.einsum("bthl,bthd->bhld", p, doc)
        delta = (doc * out[:, t0:t1].float()).sum(-1, keepdim=True)
        ds = p * (torch.einsum("bthd,bhld->bthl", doc, v) - delta) * scale
        dq[:, t0:t1] = torch.einsum("bthl,bhld->bthd", ds, k)
        dk += torch.einsum("bthl,bthd->bhld", ds, qc)
    d_values = torch.zeros(values.shape, dtype=values.dtype, device=values.device)
    d_values[..., :D] = dv.view(B, Hkv, G, L, D).sum(2)
    return dq.to(q.dtype), dk.view(B, Hkv, G, L, D).sum(2).to(keys.dtype), d_values


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, keys, values, positions, scale):
        out, lse = K.attention(q, keys, values, positions, scale)
        ctx.save_for_backward(q, keys, values, positions, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        dq, d_keys, d_values = _attention_backward(d_out, *ctx.saved_tensors, ctx.scale)
        return dq, d_keys, d_values, None, None


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = K.log_softmax(x)
        ctx.save_for_backward(y)
        ctx.dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return (dy - torch.exp(y) * dy.sum(-1, keepdim=True)).to(ctx.dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return K.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        # dx = dy @ W and dW = dy^T @ x, through the same kernel on transposed views (no copies).
        x, weight = ctx.saved_tensors
        dy = dy.to(x.dtype)
        dx = K.linear(dy, weight.t()) if ctx.needs_input_grad[0] else None
        dw = K.linear(dy.t(), x.t()) if ctx.needs_input_grad[1] else None
        db = dy.float().sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for x (..., in), through the fixed tile plan in both directions."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out = _Linear.apply(x2, weight, bias) if torch.is_grad_enabled() else K.linear(x2, weight, bias)
    return out.reshape(*lead, weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if torch.is_grad_enabled():
        return _RMSNorm.apply(x, weight, eps)
    return K.rms_norm(x, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta)): one kernel, inside autograd and out."""
    if torch.is_grad_enabled():
        return _AddRMSNorm.apply(x, delta, weight, eps)
    s, y, _ = K.add_rms_norm(x, delta, weight, eps)
    return s, y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _SiluMul.apply(gate_up) if torch.is_grad_enabled() else K.silu_mul(gate_up)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    return _Rope.apply(x, cos, signed_sin) if torch.is_grad_enabled() else K.rope(x, cos, signed_sin)


def attention(q, keys, values, positions, scale: float) -> torch.Tensor:
    """Causal GQA attention: q (B, T, Hq, D); keys, values (B, Hkv, L, D) (values may carry extra
    trailing columns, ignored); query (b, t) sees keys 0..positions[b, t]. -> (B, T, Hq, D)."""
    if torch.is_grad_enabled():
        return _Attention.apply(q, keys, values, positions, scale)
    return K.attention(q, keys, values, positions, scale)[0]


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise log-softmax, fp32 whatever x's dtype (logprobs are fp32)."""
    return _LogSoftmax.apply(x) if torch.is_grad_enabled() else K.log_softmax(x)


def sample_rows(logp: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A token per row from logp (N, V) with the counter RNG of engine/sampling.py at each row's
    step (int64 (N,))."""
    return K.sample_rows(logp, keys, steps)


def cache_write(keys, values, k, v, positions) -> None:
    """keys[b, :, positions[b, t]] = k[b, t] (values likewise, their first D columns): an exact
    copy by index_put, which gradients flow through under autograd (the trainer's shared prefixes)."""
    b_idx = torch.arange(k.shape[0], device=k.device).unsqueeze(1).expand(positions.shape)
    keys[b_idx, :, positions] = k
    values[b_idx, :, positions, : v.shape[-1]] = v
