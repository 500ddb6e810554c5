"""The fused kernels as differentiable ops: forwards in C++ (kernels/fused.cpp), backwards from
torch ops (or a C++ pass where the torch-op version was slow: linear, SiLU*up, attention).

Outside autograd (the sampler, the trainer's `forward`) each op is one kernel call. Under
autograd the forward is the same kernel, so the trainer's logprobs are the sampler's bit for bit;
the backward is the textbook gradient written with torch ops (gradients are compared with the
pure-PyTorch path to a tolerance, not bitwise: nothing consumes them bit for bit).
"""

from __future__ import annotations

import torch

from lockstep.engine import kernels

K = kernels.load()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = K.rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        r = rstd.view(*x.shape[:-1], 1)
        xhat = x * r
        g = dy * weight
        dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        dw = (dy * xhat).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return dx, dw, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return K.silu_mul(gate_up)

    @staticmethod
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        return K.silu_mul_backward(dy, gate_up)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, signed_sin):
        ctx.save_for_backward(cos, signed_sin)
        return K.rope(x, cos, signed_sin)

    @staticmethod
    def backward(ctx, dy):
        # y = x * c + roll(x, D/2) * s, so dx = dy * c + roll(dy * s, D/2) (a rotation's transpose).
        cos, signed_sin = (t.unsqueeze(2) for t in ctx.saved_tensors)
        return dy * cos + torch.roll(dy * signed_sin, dy.shape[-1] // 2, dims=-1), None, None


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, keys, values, positions, scale):
        out, lse = K.attention(q, keys, values, positions, scale)
        ctx.save_for_backward(q, keys, values, positions, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, keys, values, positions, out, lse = ctx.saved_tensors
        dq, d_keys, d_values = K.attention_backward(d_out, q, keys, values, positions, out, lse, ctx.scale)
        return dq, d_keys, d_values, None, None


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = K.log_softmax(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return dy - torch.exp(y) * dy.sum(-1, keepdim=True)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return _LogSoftmax.apply(x) if torch.is_grad_enabled() else K.log_softmax(x)


def sample_rows(logp: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A token per row from logp (N, V) with the counter RNG of engine/sampling.py at each row's
    step (int64 (N,))."""
    return K.sample_rows(logp, keys, steps)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return K.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = K.linear_backward(dy, x, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        db = K.column_sum(dy) if ctx.has_bias and ctx.needs_input_grad[2] else None
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
    """(x + delta, rms_norm(x + delta)): one kernel outside autograd, the same bits inside."""
    if torch.is_grad_enabled():
        s = x + delta
        return s, _RMSNorm.apply(s, weight, eps)
    s, y, _ = K.add_rms_norm(x, delta, weight, eps)
    return s, y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _SiluMul.apply(gate_up) if torch.is_grad_enabled() else K.silu_mul(gate_up)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    return _Rope.apply(x, cos, signed_sin) if torch.is_grad_enabled() else K.rope(x, cos, signed_sin)


def cache_write(keys, values, k, v, positions) -> None:
    """keys[b, :, positions[b, t]] = k[b, t] (values likewise, their first D columns): one kernel
    outside autograd; under autograd (the trainer's shared prefixes) an index_put that gradients
    flow through."""
    if torch.is_grad_enabled():
        b_idx = torch.arange(k.shape[0]).unsqueeze(1).expand(positions.shape)
        keys[b_idx, :, positions] = k
        values[b_idx, :, positions, : v.shape[-1]] = v
    else:
        K.cache_write(keys, values, k, v, positions)


def attention(q, keys, values, positions, scale: float) -> torch.Tensor:
    """Causal GQA attention: q (B, T, Hq, D); keys, values (B, Hkv, L, D) (values may carry extra
    trailing columns, ignored); query (b, t) sees keys 0..positions[b, t]. -> (B, T, Hq, D)."""
    if torch.is_grad_enabled():
        return _Attention.apply(q, keys, values, positions, scale)
    return K.attention(q, keys, values, positions, scale)[0]
