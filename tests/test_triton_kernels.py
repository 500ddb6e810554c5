"""The Triton kernels (engine/triton_kernels.py) and their autograd ops (engine/triton_ops.py), run
on CPU tensors under Triton's interpreter: each kernel against a torch reference, the invariance
rule (a row's bits never depend on M, its batch, padding or the KV cache's capacity), the sampler's
counter RNG bit for bit, and every op's gradient against torch autograd of a reference. The
interpreter's arithmetic is numpy's, so these check the kernels' logic and invariances, not the
GPU's bits."""

import pytest
import torch
import triton  # the gpu extra, which scripts/setup.sh installs
import triton.language as tl

from lockstep.engine import triton_kernels as K
from lockstep.engine import triton_ops as ops
from lockstep.engine.sampling import uniform

# conftest.py sets TRITON_INTERPRET=1 before anything imports triton: these are CPU tensors.
assert K._INTERPRET, "lockstep.engine.triton_kernels was imported before TRITON_INTERPRET was set"

DTYPES = [torch.float32, torch.bfloat16]
# A bf16 result is the exact value rounded once: within half an ulp, 2^-9 relative; 2^-8 leaves
# room for the fp32 arithmetic before the rounding.
BF16_RTOL = 2.0**-8


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def close(actual, expected, dtype, rtol32=1e-5, atol=1e-5):
    rtol = rtol32 if dtype == torch.float32 else BF16_RTOL
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


def ref_rms_norm(x, w, eps):
    x, w = x.float(), w.float()
    return w * (x * (1.0 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)))


def ref_silu_mul(gate_up):
    g, u = gate_up.float().chunk(2, dim=-1)
    return (g / (1.0 + torch.exp(-g))) * u


def ref_rope(x, cos, ssin):
    x = x.float()
    return x * cos.float().unsqueeze(2) + torch.roll(x, x.shape[-1] // 2, dims=-1) * ssin.float().unsqueeze(2)


def ref_attention(q, keys, values, positions, scale):
    """Dense masked softmax attention in q's (float) dtype, differentiable."""
    B, T, Hq, D = q.shape
    G = Hq // keys.shape[1]
    k = keys.repeat_interleave(G, dim=1)
    v = values[..., :D].repeat_interleave(G, dim=1)
    s = torch.einsum("bthd,bhld->bthl", q, k) * scale
    hidden = torch.arange(keys.shape[2]).view(1, 1, 1, -1) > positions.view(B, T, 1, 1)
    return torch.einsum("bthl,bhld->bthd", torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1), v)


def ref_draw(logp, keys, steps):
    """sampling._draw's torch branch: inverse CDF by cumsum and searchsorted."""
    cdf = torch.cumsum(torch.exp(logp.double()), dim=-1)
    u = uniform(keys, steps) * cdf[:, -1]
    return torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1).clamp_(max=logp.shape[-1] - 1)


# -- forwards against references -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_reference_across_tiles_and_strides(dtype):
    # 130 x 150 outputs over K = 200: several M, N and K blocks with ragged edges in both configs.
    x, w, b = rand(130, 200, dtype=dtype), rand(150, 200, seed=1, dtype=dtype), rand(150, seed=2)
    y = K.linear(x, w, b)
    assert y.dtype == dtype and y.shape == (130, 150)
    close(y, x.double() @ w.double().T + b.double(), dtype, atol=1e-4)
    assert torch.equal(K.linear(x, w), K.linear(x, w.T.contiguous().T))  # strides, not copies
    assert torch.equal(K.linear(x, w), K.linear(x.T.contiguous().T, w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_add_rms_norm(dtype):
    x, d, w = rand(3, 4, 1500, dtype=dtype), rand(3, 4, 1500, seed=1, dtype=dtype), rand(1500, seed=2, dtype=dtype)
    y, rstd = K.rms_norm(x, w, 1e-6)
    assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (12,)
    close(y, ref_rms_norm(x, w, 1e-6), dtype)
    close(rstd, 1.0 / torch.sqrt(x.float().pow(2).mean(-1) + 1e-6).flatten(), torch.float32)
    s, y2, rstd2 = K.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(s, (x.float() + d.float()).to(dtype))  # one rounding of the fp32 sum, like torch's add
    y_s, rstd_s = K.rms_norm(s, w, 1e-6)
    assert torch.equal(y2, y_s) and torch.equal(rstd2, rstd_s)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_softmax_silu_mul_rope(dtype):
    z = rand(3, 5000, dtype=dtype) * 4  # more than one 4096 chunk
    y = K.log_softmax(z)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, torch.log_softmax(z.float(), dim=-1), rtol=0, atol=2e-5)
    gu = rand(2, 3, 2 * 1100, seed=1, dtype=dtype) * 3
    close(K.silu_mul(gu), ref_silu_mul(gu), dtype, atol=1e-6)
    # x a view of a wider projection (any strides but the last), as q and k are in the model.
    qkv = rand(2, 5, 3 * 4 * 16, seed=2, dtype=dtype)
    x = qkv[..., 16:16 + 4 * 16].view(2, 5, 4, 16)
    cos, ssin = rand(2, 5, 16, seed=3, dtype=dtype), rand(2, 5, 16, seed=4, dtype=dtype)
    close(K.rope(x, cos, ssin), ref_rope(x, cos, ssin), dtype, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv", [(4, 2), (3, 1)])
def test_attention_matches_reference(dtype, hq, hkv):
    B, T, D, L = 3, 9, 16, 80
    q = rand(B, T, hq, D, dtype=dtype)
    cache_t = rand(B, hkv, D, L, seed=1, dtype=dtype)  # keys stored transposed, passed as a view
    keys = cache_t.transpose(2, 3)
    values = rand(B, hkv, L, D + 3, seed=2, dtype=dtype)  # extra trailing columns, ignored
    positions = torch.tensor([list(range(T)), list(range(40, 40 + T)), [70] * T])
    out, lse = K.attention(q, keys, values, positions, 0.25)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref = ref_attention(q.double(), keys.double(), values.double(), positions, 0.25)
    # bf16: the probabilities are rounded to bf16 for the P @ V product (as in flash attention).
    close(out, ref, dtype, atol=1e-5 if dtype == torch.float32 else 1e-2)
    G = hq // hkv
    s = torch.einsum("bthd,bhld->bthl", q.double(), keys.double().repeat_interleave(G, 1)) * 0.25
    hidden = torch.arange(L).view(1, 1, 1, -1) > positions.view(B, T, 1, 1)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s.masked_fill(hidden, float("-inf")), -1),
                               rtol=1e-5, atol=1e-5)


# -- the invariance rule ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_m(dtype):
    x, w, b = rand(130, 96, dtype=dtype), rand(80, 96, seed=1, dtype=dtype), rand(80, seed=2, dtype=dtype)
    y5, y37, y130 = (K.linear(x[:m], w, b) for m in (5, 37, 130))
    assert torch.equal(y5, y37[:5]) and torch.equal(y5, y130[:5]) and torch.equal(y37, y130[:37])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_linear_row_has_the_same_bits_at_every_position_of_a_tile(dtype):
    """The sampler's decode puts a token in row b of a tile, the trainer's forward in row t: a row's
    bits must not depend on where in the tile it sits. (Under the interpreter, tl.dot is numpy's
    matmul, whose OpenBLAS kernels on an AMD EPYC give rows 6-11 of every 12 other last bits than
    rows 0-5: the consistency check then failed in fp32. _dot sums the products itself there.)"""
    x, w = rand(1, 96, dtype=dtype), rand(80, 96, seed=1, dtype=dtype)
    alone = K.linear(x, w)[0]
    block_m = K._LINEAR_CONFIG[dtype][0]
    moved = [p for p in range(block_m) if not torch.equal(
        K.linear(torch.zeros(block_m, 96, dtype=dtype).index_copy_(0, torch.tensor([p]), x), w)[p], alone)]
    assert moved == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_kernels_give_a_row_the_same_bits_alone_and_in_a_batch(dtype):
    x, d, w = rand(6, 1300, dtype=dtype), rand(6, 1300, seed=1, dtype=dtype), rand(1300, seed=2, dtype=dtype)
    z = rand(6, 4500, seed=3, dtype=dtype) * 3
    gu = rand(6, 2 * 300, seed=4, dtype=dtype)
    xr, cos, ssin = (rand(*shape, seed=seed, dtype=dtype) for shape, seed in (((6, 3, 4, 16), 5), ((6, 3, 16), 6),
                                                                               ((6, 3, 16), 7)))
    batch = {
        "rms_norm": K.rms_norm(x, w, 1e-5)[0],
        "add_rms_norm": K.add_rms_norm(x, d, w, 1e-5)[1],
        "log_softmax": K.log_softmax(z),
        "silu_mul": K.silu_mul(gu),
        "rope": K.rope(xr, cos, ssin),
    }
    for i in (0, 3, 5):
        alone = {
            "rms_norm": K.rms_norm(x[i:i + 1], w, 1e-5)[0],
            "add_rms_norm": K.add_rms_norm(x[i:i + 1], d[i:i + 1], w, 1e-5)[1],
            "log_softmax": K.log_softmax(z[i:i + 1]),
            "silu_mul": K.silu_mul(gu[i:i + 1]),
            "rope": K.rope(xr[i:i + 1], cos[i:i + 1], ssin[i:i + 1]),
        }
        for name, y in alone.items():
            assert torch.equal(y[0], batch[name][i]), (name, i)


def _cache(k_rows, capacity, dtype):
    """A KV cache (B, Hkv, capacity, D) stored transposed (as a view), its first rows the given keys
    and NaN past them: slots a query must not see may hold anything."""
    B, Hkv, n, D = k_rows.shape
    cache_t = torch.full((B, Hkv, D, capacity), float("nan"), dtype=dtype)
    keys = cache_t.transpose(2, 3)
    keys[:, :, :n] = k_rows
    return keys


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_equals_prefill_for_any_capacity_and_batch(dtype):
    T, Hq, Hkv, D = 70, 4, 2, 16  # 70 keys: three key blocks in either config
    q = rand(1, T, Hq, D, dtype=dtype)
    k_rows, v_rows = rand(1, Hkv, T, D, seed=1, dtype=dtype), rand(1, Hkv, T, D, seed=2, dtype=dtype)
    prefill_out, prefill_lse = K.attention(q, k_rows, v_rows, torch.arange(T).unsqueeze(0), 0.3)

    for capacity in (T, 96, 200):
        keys, values = _cache(k_rows, capacity, dtype), _cache(v_rows, capacity, dtype)
        for p in (0, 31, 32, 33, 64, T - 1):
            out, lse = K.attention(q[:, p:p + 1], keys, values, torch.tensor([[p]]), 0.3)
            assert torch.equal(out[0, 0], prefill_out[0, p]), (capacity, p)
            assert torch.equal(lse[0, 0], prefill_lse[0, p]), (capacity, p)

    # A batch of three: the row of interest in the middle, a shorter and a longer neighbour, two
    # queries each (a speculative verify's shape), in a cache of yet another capacity.
    capacity, p = 130, 45
    others_k, others_v = rand(3, Hkv, capacity, D, seed=5, dtype=dtype), rand(3, Hkv, capacity, D, seed=6, dtype=dtype)
    others_k[1, :, :T], others_v[1, :, :T] = k_rows[0], v_rows[0]
    q3 = rand(3, 2, Hq, D, seed=7, dtype=dtype)
    q3[1] = q[0, p:p + 2]
    out, lse = K.attention(q3, others_k, others_v, torch.tensor([[3, 4], [p, p + 1], [120, 129]]), 0.3)
    assert torch.equal(out[1], prefill_out[0, p:p + 2]) and torch.equal(lse[1], prefill_lse[0, p:p + 2])


# -- sampling --------------------------------------------------------------------------------------


@triton.jit
def _uniform_kernel(keys_ptr, steps_ptr, out_ptr):
    row = tl.program_id(0)
    tl.store(out_ptr + row, K._uniform(tl.load(keys_ptr + row), tl.load(steps_ptr + row)))


def test_in_kernel_uniform_is_samplings_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    keys = torch.cat((torch.tensor([0, 1, 2**32 - 1, -1, -(2**40)]), torch.randint(0, 2**32, (195,), generator=g)))
    steps = torch.cat((torch.tensor([0, 1, 2**62, -1, 7]), torch.randint(0, 2**40, (195,), generator=g)))
    u = torch.empty(200, dtype=torch.float64)
    _uniform_kernel[(200,)](keys, steps, u)
    assert torch.equal(u, uniform(keys, steps))


def test_sample_rows_draws_the_torch_fallbacks_token_and_ignores_other_rows():
    g = torch.Generator().manual_seed(1)
    N, V = 200, 2500  # three 1024-wide blocks
    temperature = torch.rand(N, 1, generator=g) * 4 + 0.1  # peaked and flat rows
    logits = torch.randn(N, V, generator=g) / temperature
    logits[::7, 100:2400] = float("-inf")  # truncated rows: tokens outside never drawn
    logp = torch.log_softmax(logits, dim=-1)
    keys = torch.randint(0, 2**32, (N,), generator=g)
    steps = torch.randint(0, 10_000, (N,), generator=g)
    tokens = K.sample_rows(logp, keys, steps)
    assert torch.equal(tokens, ref_draw(logp, keys, steps))
    assert bool(torch.isfinite(logp.gather(1, tokens.unsqueeze(1))).all())
    for i in (0, 7, 199):
        assert K.sample_rows(logp[i:i + 1], keys[i:i + 1], steps[i:i + 1]).item() == tokens[i].item()
    assert torch.equal(ops.sample_rows(logp, keys, steps), tokens)


def test_cache_write_is_an_exact_copy_into_a_transposed_cache():
    B, T, H, D, L = 2, 3, 2, 8, 10
    keys = torch.zeros(B, H, D, L).transpose(2, 3)
    values = torch.zeros(B, H, L, D + 2)
    k, v = rand(B, T, H, D), rand(B, T, H, D, seed=1)
    positions = torch.tensor([[0, 1, 2], [5, 6, 9]])
    ops.cache_write(keys, values, k, v, positions)
    for b in range(B):
        for t in range(T):
            assert torch.equal(keys[b, :, positions[b, t]], k[b, t])
            assert torch.equal(values[b, :, positions[b, t], :D], v[b, t])
    assert int((values[..., D:] != 0).sum()) == 0


# -- autograd --------------------------------------------------------------------------------------


def _grads(fn, inputs, seed=9):
    """fn(*inputs) and the gradients of a random projection of its outputs."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.float() * rand(*o.shape, seed=seed + i)).sum() for i, o in enumerate(outs))
    loss.backward()
    return outs, [leaf.grad for leaf in leaves if leaf.requires_grad]


def _check_op(op, ref, inputs, atol=1e-4):
    outs, grads = _grads(op, inputs)
    ref_outs, ref_grads = _grads(ref, inputs)
    with torch.no_grad():
        plain = op(*inputs)
    plain = plain if isinstance(plain, tuple) else (plain,)
    for o, p in zip(outs, plain):
        assert torch.equal(o.detach(), p)  # the same kernel under autograd and outside it
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o.detach().double(), r.detach().double(), rtol=1e-4, atol=atol)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-4, atol=atol)


def test_linear_gradients():
    x, w, b = rand(2, 5, 24), rand(16, 24, seed=1), rand(16, seed=2)
    _check_op(ops.linear, lambda x, w, b: x @ w.T + b, (x, w, b))
    _check_op(lambda x, w: ops.linear(x, w), lambda x, w: x @ w.T, (x, w))


def test_bf16_linear_gradients_stay_bf16_and_close():
    x, w = rand(7, 40, dtype=torch.bfloat16), rand(24, 40, seed=1, dtype=torch.bfloat16)
    (y,), (gx, gw) = _grads(ops.linear, (x, w))
    (_,), (rx, rw) = _grads(lambda x, w: x.float() @ w.float().T, (x.float(), w.float()))
    assert gx.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(gx.float(), rx, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw.float(), rw, rtol=2e-2, atol=2e-2)


def test_norm_gradients():
    x, d, w = rand(2, 3, 40), rand(2, 3, 40, seed=1), rand(40, seed=2)
    _check_op(lambda x, w: ops.rms_norm(x, w, 1e-6), lambda x, w: ref_rms_norm(x, w, 1e-6), (x, w))
    _check_op(lambda x, d, w: ops.add_rms_norm(x, d, w, 1e-6),
              lambda x, d, w: (x + d, ref_rms_norm(x + d, w, 1e-6)), (x, d, w))


def test_elementwise_and_log_softmax_gradients():
    _check_op(ops.silu_mul, ref_silu_mul, (rand(3, 4, 2 * 24) * 3,))
    x, cos, ssin = rand(2, 5, 3, 16), rand(2, 5, 16, seed=1), rand(2, 5, 16, seed=2)
    _check_op(lambda x: ops.rope(x, cos, ssin), lambda x: ref_rope(x, cos, ssin), (x,))
    _check_op(ops.log_softmax, lambda z: torch.log_softmax(z, dim=-1), (rand(4, 300) * 3,))


def test_attention_gradients(monkeypatch):
    monkeypatch.setattr(ops, "_ATTENTION_BACKWARD_ELEMENTS", 2 * 4 * 40 * 3)  # chunks of 3 query positions
    B, T, Hq, Hkv, D, L = 2, 8, 4, 2, 16, 40
    q, keys, values = rand(B, T, Hq, D), rand(B, Hkv, L, D, seed=1), rand(B, Hkv, L, D + 2, seed=2)
    positions = torch.tensor([list(range(T)), list(range(20, 20 + T))])
    _check_op(lambda q, k, v: ops.attention(q, k, v, positions, 0.25),
              lambda q, k, v: ref_attention(q, k, v, positions, 0.25), (q, keys, values))
