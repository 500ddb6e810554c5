"""Batch-invariant Triton kernels of lockstep's forward on CUDA, shared by the sampler and the trainer.

THE INVARIANCE RULE. Every output element is computed by one program, through one code path, and
every reduction behind it runs in one fixed order that depends only on the reduction's own length
(the hidden size, the head size, the number of keys visible to a query): never on the batch size
or M, a row's place in the batch, padding, the KV cache's capacity or the grid size. Programs
split the work only between independent outputs (rows, output tiles, heads, query blocks); no
reduction is ever split between programs: no split-K, no atomics. Hence a token's result is the
same bits in a KV-cache decode step and in a padded full-sequence forward, which is what lets the
sampler's logprobs equal the trainer's.

How each kernel keeps it:
- linear: a persistent matmul over output tiles of one fixed size per dtype (_LINEAR_CONFIG),
  never a function of M; a tile's K loop runs in ascending order with an fp32 accumulator. The
  grid (min(tiles, SMs)) only decides which program computes a tile, never how.
- rms_norm, add_rms_norm, log_softmax, sample_rows: one row per program; the row is walked in
  chunks of a size fixed by its length, each lane accumulates its elements in order, then one
  tl.sum. tl.sum's tree follows the register layout, which Triton derives from the pointers'
  alignment: these kernels are compiled without alignment or stride specialization
  (do_not_specialize*), so there is one compiled variant, hence one tree, per dtype and length.
- attention: one program per (batch row, kv head, block of query rows), the rows being the
  flattened (t, group head) pairs; an online softmax over key blocks of a fixed size, in
  ascending order from key 0, up to the last block any of the program's rows sees. Keys past a
  row's position score -inf, and a block with no key visible to a row leaves that row's running
  max, sum and accumulator exactly unchanged (alpha is 1, p is 0), so the extra blocks a longer
  neighbour or a bigger cache makes the program walk change no bit.
- silu_mul, rope: elementwise, no reductions.
Sizes that vary with the batch (M, T, L) are never specialized on, so a decode step and a prefill
run the same compiled kernel.

What is exact and what is not. Activations and weights are stored in the model's dtype (bf16 or
fp32); every product is accumulated in fp32 (a bf16 x bf16 product is exact in fp32), fp32 inputs
go through IEEE fp32 dots (never TF32), and each output is rounded once to the storage dtype.
rms_norm's statistics, silu, rope and the softmax run in fp32; logprobs (log_softmax) and
attention's lse are fp32 whatever the input dtype; sample_rows draws in fp64 with the counter RNG
of engine/sampling.py bit for bit. exp and log are the GPU's fast approximations (deterministic,
a few ulp from the correctly rounded value); divisions and square roots that the formulas spell
out are IEEE round-to-nearest (div_rn, sqrt_rn). Results therefore match a torch reference to a
tolerance, and match themselves bit for bit across batch shapes.

The interpreter (TRITON_INTERPRET=1, CPU tensors, used by the tests) changes three things, all
behind the module constant _INTERPRETER (a tl.constexpr): its tl.dot is wrong on bf16 tiles, so
16-bit tiles go in as fp32 (_dot_in; exact, as a bf16 product is exact in fp32); its fp32 -> bf16
cast truncates, so bf16 results are rounded to nearest even by hand (_round); and its tl.dot is
numpy's matmul, whose BLAS can give a row other bits at another position in the tile, so _dot
sums the products itself there (the invariance rule must hold under the interpreter too). On a
GPU tl.dot gets the 16-bit tiles (tensor cores, fp32 accumulation) and the cast is the
hardware's round-to-nearest-even. The persistent matmul's program count is the SM count on a GPU
and _INTERPRETER_PROGRAMS under the interpreter (the grid never changes a bit). The interpreter's
exp, log and products are numpy's, so its bits are not the GPU's; only the invariances carry
over.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# triton.jit reads TRITON_INTERPRET when a kernel is decorated; read it once, the same way.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRETER = tl.constexpr(_INTERPRET)
_INTERPRETER_PROGRAMS = 4

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per dtype: fixed, never a function of M. The
# interpreter runs the same sizes (numpy handles a 128x128 tile at about the cost of a small one).
_LINEAR_CONFIG = {
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float16: (128, 128, 64, 8, 3),
    torch.float32: (64, 64, 32, 4, 3),
}
# (BLOCK_M query rows, BLOCK_N keys, num_warps, num_stages) per dtype.
_ATTENTION_CONFIG = {
    torch.bfloat16: (64, 64, 4, 2),
    torch.float16: (64, 64, 4, 2),
    torch.float32: (32, 32, 4, 2),
}
# Largest chunk of a row that the row kernels walk at once (the chunk is min(this, next pow2 of
# the row's length): a function of the length only).
_NORM_CHUNK, _SOFTMAX_CHUNK, _SAMPLE_CHUNK, _ELEMENTWISE_CHUNK = 1024, 4096, 1024, 1024
_ROW_WARPS = 4

_2_POW_M32 = tl.constexpr(2.0**-32)


@triton.jit
def _dot_in(tile):
    """A tile as tl.dot takes it. Interpreter only: its tl.dot is wrong on 16-bit tiles, so they go
    in as fp32 (exact: a bf16 or fp16 product is exact in fp32). On a GPU they stay 16-bit (tensor
    cores, fp32 accumulation)."""
    if _INTERPRETER:
        return tile.to(tl.float32)
    else:
        return tile


@triton.jit
def _dot(a, b, acc):
    """acc + a @ b, fp32 accumulation. On a GPU: tl.dot (16-bit tiles on the tensor cores, fp32 tiles
    in IEEE fp32, no TF32). Interpreter only: the products summed over K with numpy's reduction,
    not tl.dot's np.matmul, whose BLAS gives a row other bits at another position in the tile on
    some CPUs (OpenBLAS's kernels on an AMD EPYC: rows 6-11 of every 12 differ from rows 0-5 in
    the last bit), which would make a row's result depend on where the batch puts it."""
    if _INTERPRETER:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 x rounded to nearest even in dtype. Interpreter only: its fp32 -> bf16 cast truncates,
    so bf16 is rounded by hand there (on a GPU the cast is cvt.rn, the same bits)."""
    if _INTERPRETER and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


def _chunk(n: int, cap: int) -> int:
    return min(cap, triton.next_power_of_2(n))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _persistent_programs(device: torch.device) -> int:
    if _INTERPRET:
        return _INTERPRETER_PROGRAMS
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., n) as (N, n) with a contiguous last dim (a copy only where the view cannot be had)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# -- linear ---------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M", "num_programs"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn, num_programs,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    rk = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), tiles, num_programs):
        rm = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * sxm
        w_cols = w_ptr + rn.to(tl.int64)[None, :] * swn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(x_rows + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_cols + kk[:, None] * swk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
            # "ieee" matters for fp32 tiles only (no TF32); 16-bit tiles take the tensor cores.
            acc = _dot(_dot_in(a), _dot_in(b), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rm.to(tl.int64)[:, None] * sym + rn.to(tl.int64)[None, :] * syn
        tl.store(y, _round(acc, y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias (N,), added in fp32 before the rounding) -> (M, N) in x's
    dtype. Any strides (the backward passes transposed views)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if x.dtype != weight.dtype or x.dtype not in _LINEAR_CONFIG:
        raise TypeError(f"linear: x and weight must share a dtype of {list(_LINEAR_CONFIG)}")
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    block_m, block_n, block_k, warps, stages = _LINEAR_CONFIG[x.dtype]
    programs = min(triton.cdiv(M, block_m) * triton.cdiv(N, block_n), _persistent_programs(x.device))
    _linear_kernel[(programs,)](
        x, weight, bias.contiguous() if bias is not None else y, y, M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1), programs,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return y


# -- row kernels -----------------------------------------------------------------------------------


def _row_kernel(*pointers: str):
    """triton.jit for a row kernel: no specialization on the row stride or the pointers' alignment,
    so one compiled variant (one register layout, one tl.sum tree) serves every batch layout."""
    return triton.jit(do_not_specialize=["stride"], do_not_specialize_on_alignment=list(pointers))


@triton.jit
def _sum_squares(x_ptr, d_ptr, H, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    """sum over the row of v^2, v = x or round(x + delta) to x's dtype: lanes in order, then tl.sum."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + cols, mask=cols < H, other=0.0)
        if HAS_DELTA:
            v = _round(v.to(tl.float32) + tl.load(d_ptr + cols, mask=cols < H, other=0.0).to(tl.float32), v.dtype)
        v = v.to(tl.float32)
        acc += v * v
    return tl.sum(acc, 0)


@_row_kernel("x_ptr", "d_ptr", "w_ptr", "s_ptr", "y_ptr", "r_ptr")
def _rms_norm_kernel(x_ptr, d_ptr, w_ptr, s_ptr, y_ptr, r_ptr, stride, H, eps,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride
    d_row = d_ptr + row * stride
    mean = tl.div_rn(_sum_squares(x_row, d_row, H, HAS_DELTA, BLOCK), H * 1.0)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        v = tl.load(x_row + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            # Recomputed rather than re-read from s: the same bits, no store-to-load ordering to rely on.
            v = _round(v.to(tl.float32) + tl.load(d_row + cols, mask=mask, other=0.0).to(tl.float32), v.dtype)
            tl.store(s_ptr + row * H + cols, v, mask=mask)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * H + cols, _round(w * (v.to(tl.float32) * rstd), y_ptr.dtype.element_ty), mask=mask)
    tl.store(r_ptr + row, rstd)


def _norm(x, delta, weight, eps):
    H = x.shape[-1]
    if weight.numel() != H:
        raise ValueError(f"rms_norm: weight has {weight.numel()} elements, expected {H}")
    x2 = _rows(x)
    d2 = _rows(delta) if delta is not None else x2
    if d2.stride(0) != x2.stride(0):
        x2, d2 = x2.contiguous(), d2.contiguous()
    N = x2.shape[0]
    y = torch.empty((N, H), dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if delta is not None else y
    rstd = torch.empty(N, dtype=torch.float32, device=x.device)
    if N:
        _rms_norm_kernel[(N,)](x2, d2, weight.contiguous(), s, y, rstd, x2.stride(0), H, float(eps),
                               HAS_DELTA=delta is not None, BLOCK=_chunk(H, _NORM_CHUNK), num_warps=_ROW_WARPS)
    return s.view(x.shape), y.view(x.shape), rstd


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., H) -> (weight * (x * (1 / sqrt(mean(x^2) + eps))) in x's dtype, rstd (N,) fp32), all in fp32."""
    _, y, rstd = _norm(x, None, weight, eps)
    return y, rstd


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(s = x + delta rounded to x's dtype, rms_norm(s), rstd): the residual add and the next norm in one pass."""
    if x.shape != delta.shape:
        raise ValueError("add_rms_norm: x and delta differ in shape")
    return _norm(x, delta, weight, eps)


@_row_kernel("x_ptr", "y_ptr")
def _log_softmax_kernel(x_ptr, y_ptr, stride, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32))
    row_max = tl.max(m, 0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        acc += tl.where(cols < V, tl.exp(x - row_max), 0.0)
    lse = tl.log(tl.sum(acc, 0))
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * V + cols, (x - row_max) - lse, mask=cols < V)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise log-softmax over the last dim: x - max - log(sum exp(x - max)), fp32 out whatever x's dtype."""
    x2 = _rows(x)
    N, V = x2.shape
    y = torch.empty((N, V), dtype=torch.float32, device=x.device)
    if N:
        _log_softmax_kernel[(N,)](x2, y, x2.stride(0), V, BLOCK=_chunk(V, _SOFTMAX_CHUNK), num_warps=_ROW_WARPS)
    return y.view(x.shape)


# -- sampling --------------------------------------------------------------------------------------


@triton.jit
def _uniform(key, step):
    """engine/sampling.py's uniform(key, step) bit for bit: splitmix64(step), its low 32 bits xor
    the key's, through _hash32, then (h + 0.5) / 2^32 in fp64 (exact)."""
    x = step.to(tl.uint64, bitcast=True) + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    x = x ^ (x >> 31)
    h = ((key.to(tl.uint64, bitcast=True) ^ x) & 0xFFFFFFFF).to(tl.uint32)
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D  # uint32 arithmetic wraps mod 2^32, as & M32 does in sampling.py
    h = h ^ (h >> 15)
    h = h * 0x5BD1E995
    h = h ^ (h >> 16)
    return (h.to(tl.float64) + 0.5) * _2_POW_M32


@_row_kernel("logp_ptr", "keys_ptr", "steps_ptr", "out_ptr")
def _sample_rows_kernel(logp_ptr, keys_ptr, steps_ptr, out_ptr, stride, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p_row = logp_ptr + row * stride
    total = tl.full((), 0.0, tl.float64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        total += tl.sum(tl.exp(tl.load(p_row + cols, mask=cols < V, other=float("-inf")).to(tl.float64)), 0)
    target = _uniform(tl.load(keys_ptr + row), tl.load(steps_ptr + row)) * total
    # The first index whose running cdf exceeds the target (V - 1 if rounding leaves none); the
    # running prefix adds the same block sums in the same order as total.
    token = V - 1
    prefix = tl.full((), 0.0, tl.float64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        p = tl.exp(tl.load(p_row + cols, mask=cols < V, other=float("-inf")).to(tl.float64))
        hit = (prefix + tl.cumsum(p, 0) > target) & (cols < V)
        token = tl.minimum(token, tl.min(tl.where(hit, cols, V), 0))
        prefix += tl.sum(p, 0)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_rows(logp: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A token per row of logp (N, V) fp32 by inverse CDF (fp64) at the counter-RNG uniform of
    (keys[r], steps[r]) (int64 (N,)) -> int64 (N,)."""
    if logp.dtype != torch.float32 or logp.dim() != 2:
        raise TypeError("sample_rows: logp must be fp32 (N, V)")
    if keys.dtype != torch.int64 or steps.dtype != torch.int64 or keys.numel() != logp.shape[0] \
            or steps.numel() != logp.shape[0]:
        raise TypeError("sample_rows: keys and steps must be int64 (N,)")
    logp = _rows(logp)
    N, V = logp.shape
    tokens = torch.empty(N, dtype=torch.int64, device=logp.device)
    if N:
        _sample_rows_kernel[(N,)](logp, keys.contiguous(), steps.contiguous(), tokens, logp.stride(0), V,
                                  BLOCK=_chunk(V, _SAMPLE_CHUNK), num_warps=_ROW_WARPS)
    return tokens


# -- elementwise -----------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(g_ptr, y_ptr, stride, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(g_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptr + row * stride + F + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * F + cols, _round(tl.div_rn(g, 1.0 + tl.exp(-g)) * u, y_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (..., 2F) -> silu(gate) * up (..., F), silu(g) = g / (1 + exp(-g)), in fp32."""
    if gate_up.shape[-1] % 2:
        raise ValueError("silu_mul: gate_up's last dimension must be even")
    g2 = _rows(gate_up)
    N, F = g2.shape[0], g2.shape[1] // 2
    y = torch.empty((N, F), dtype=gate_up.dtype, device=gate_up.device)
    if N and F:
        block = _chunk(F, _ELEMENTWISE_CHUNK)
        _silu_mul_kernel[(N, triton.cdiv(F, block))](g2, y, g2.stride(0), F, BLOCK=block)
    return y.view(*gate_up.shape[:-1], F)


@triton.jit
def _rope_kernel(x_ptr, c_ptr, s_ptr, y_ptr, T, H, sxb, sxt, sxh, D: tl.constexpr, BLOCK_D: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x_row = x_ptr + (bt // T) * sxb + (bt % T) * sxt + h * sxh
    x = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)
    rolled = tl.load(x_row + (d + D // 2) % D, mask=mask, other=0.0).to(tl.float32)  # roll by D/2
    c = tl.load(c_ptr + bt * D + d, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + bt * D + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + (bt * H + h) * D + d, _round(x * c + rolled * s, y_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D) (last dim contiguous, else copied), cos and signed_sin (B, T, D) ->
    x * cos + roll(x, D/2, -1) * signed_sin, contiguous (B, T, H, D) in x's dtype (fp32 math)."""
    B, T, H, D = x.shape
    if D % 2 or cos.shape != (B, T, D) or signed_sin.shape != (B, T, D):
        raise ValueError("rope: x must be (B, T, H, D) with D even and the tables (B, T, D)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    if y.numel():
        _rope_kernel[(B * T, H)](x, cos.contiguous(), signed_sin.contiguous(), y, T, H,
                                 x.stride(0), x.stride(1), x.stride(2), D=D, BLOCK_D=triton.next_power_of_2(D))
    return y


# -- attention -------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T", "L"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, lse_ptr, T, L, G, Hkv, scale,
                      sqb, sqt, sqh, skb, skh, skl, skd, svb, svh, svl, spb, spt,
                      D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0) // Hkv
    kv_head = tl.program_id(0) % Hkv
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows: flattened (t, group head)
    t = r // G
    head = kv_head * G + r % G
    row_ok = r < T * G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # A padding row (r >= T*G) gets position 0: it sees key 0, stays finite, and is never stored.
    pos = tl.load(pos_ptr + b * spb + t * spt, mask=row_ok, other=0).to(tl.int32)
    q_rows = q_ptr + b.to(tl.int64) * sqb + t.to(tl.int64)[:, None] * sqt + head[:, None] * sqh
    q = _dot_in(tl.load(q_rows + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0))
    k_base = k_ptr + b.to(tl.int64) * skb + kv_head.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + kv_head.to(tl.int64) * svh
    last = tl.max(pos, 0)  # the program's last visible key; keys past it (and past L) are never read

    # Every row sees key 0, which is in the first block, so the running max is finite from the
    # first block on and -inf - -inf never happens.
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start in range(0, last + 1, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = (j <= last) & (j < L)
        kt = tl.load(k_base + j.to(tl.int64)[None, :] * skl + d[:, None] * skd, mask=d_ok[:, None] & j_ok[None, :],
                     other=0.0)
        v = tl.load(v_base + j.to(tl.int64)[:, None] * svl + d[None, :], mask=j_ok[:, None] & d_ok[None, :],
                    other=0.0)
        visible = j[None, :] <= pos[:, None]
        s = tl.where(visible, _dot(q, _dot_in(kt), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A block with nothing visible to a row must leave it exactly unchanged: alpha exactly 1
        # (not exp(0), which an approximate exp need not return exactly), p exactly 0.
        alpha = tl.where(m_new == m_i, 1.0, tl.exp(m_i - m_new))
        p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = _dot_in(_round(p, v.dtype))  # p in the values' dtype, as flash attention does
        acc = _dot(pv, _dot_in(v), acc * alpha[:, None])
        m_i = m_new
    out = tl.div_rn(acc, l_i[:, None])
    o_rows = o_ptr + ((b * T + t).to(tl.int64) * (Hkv * G) + head)[:, None] * D
    tl.store(o_rows + d[None, :], _round(out, o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + (b * T + t).to(tl.int64) * (Hkv * G) + head, m_i + tl.log(l_i), mask=row_ok)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal GQA attention. q (B, T, Hq, D); keys (B, Hkv, L, D) with any strides (a transposed
    cache view is fine); values (B, Hkv, L, >=D) (extra trailing columns ignored); positions
    (B, T) int64, each < L: query (b, t) sees keys 0..positions[b, t]. scale multiplies q.k in
    fp32. -> (out (B, T, Hq, D) in q's dtype, lse (B, T, Hq) fp32: the log-sum-exp of the scaled
    scores)."""
    B, T, Hq, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    if Hq % Hkv or keys.shape != (B, Hkv, L, D) or values.shape[:3] != (B, Hkv, L) or values.shape[3] < D:
        raise ValueError("attention: shapes do not match q (B, T, Hq, D), keys and values (B, Hkv, L, D)")
    if positions.shape != (B, T) or positions.dtype != torch.int64:
        raise ValueError("attention: positions must be int64 (B, T)")
    if not (q.dtype == keys.dtype == values.dtype) or q.dtype not in _ATTENTION_CONFIG:
        raise TypeError(f"attention: q, keys and values must share a dtype of {list(_ATTENTION_CONFIG)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if values.stride(-1) != 1:
        values = values.contiguous()
    G = Hq // Hkv
    out = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, T, Hq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    block_m, block_n, warps, stages = _ATTENTION_CONFIG[q.dtype]
    grid = (B * Hkv, triton.cdiv(T * G, block_m))
    _attention_kernel[grid](
        q, keys, values, positions, out, lse, T, L, G, Hkv, float(scale),
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3),
        values.stride(0), values.stride(1), values.stride(2), positions.stride(0), positions.stride(1),
        D=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
        num_warps=warps, num_stages=stages)
    return out, lse
