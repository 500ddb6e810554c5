"""The fused CPU kernels (engine/kernels/fused.cpp): each op against the pure-PyTorch one, the
invariance rule (a row's bits never depend on its batch, padding, cache capacity or the thread
count), gradients, and the fallback when the kernels are not built."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lockstep.engine import fused
from lockstep.engine import invariant as inv

assert fused.K is not None, "the fused kernels are not built: run scripts/setup.sh (or python -m lockstep.engine.kernels)"


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def eager_attention(q, keys, values, positions, scale):
    """Reference: dense masked softmax attention in float64."""
    B, T, Hq, D = q.shape
    G = Hq // keys.shape[1]
    k = keys.double().repeat_interleave(G, dim=1)  # (B, Hq, L, D)
    v = values[..., :D].double().repeat_interleave(G, dim=1)
    s = torch.einsum("bthd,bhld->bthl", q.double(), k) * scale
    hidden = torch.arange(keys.shape[2]).view(1, 1, 1, -1) > positions.view(B, T, 1, 1)
    p = torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1)
    return torch.einsum("bthl,bhld->bthd", p, v)


def test_each_op_computes_what_the_pure_pytorch_op_does():
    x, w = rand(6, 40), rand(40, seed=1)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), inv.rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6)
    d = rand(6, 40, seed=2)
    s, y = fused.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(s, x + d)
    torch.testing.assert_close(y, inv.rms_norm(x + d, w, 1e-6), rtol=1e-6, atol=1e-6)
    gu = rand(5, 3, 2 * 24) * 4
    g, u = gu.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(gu), inv.silu(g) * u, rtol=1e-6, atol=1e-6)
    qk, cos, sin = rand(2, 7, 5, 16), rand(2, 7, 16, seed=3), rand(2, 7, 16, seed=4)
    cos, ssin = inv.rope_tables(cos, sin)
    torch.testing.assert_close(fused.rope(qk, cos, ssin), inv.apply_rope(qk, cos.unsqueeze(2), ssin.unsqueeze(2)),
                               rtol=1e-6, atol=1e-6)
    q, keys, values = rand(3, 9, 4, 16), rand(3, 2, 32, 16, seed=5), rand(3, 2, 32, 17, seed=6)
    positions = torch.tensor([list(range(9)), list(range(3, 12)), [20] * 9])
    torch.testing.assert_close(fused.attention(q, keys, values, positions, 0.25).double(),
                               eager_attention(q, keys, values, positions, 0.25), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_rows_bits_never_depend_on_its_batch_padding_cache_or_threads(threads):
    """One query row alone, single-threaded, is the reference; in a batch of other rows, at
    another place, with a longer key buffer and more threads, its output is the same bits."""
    torch.set_num_threads(1)
    q, keys, values = rand(1, 1, 4, 32), rand(1, 2, 32, 32, seed=1), rand(1, 2, 32, 33, seed=2)
    pos = torch.tensor([[13]])
    alone = fused.attention(q, keys, values, pos, 0.17)
    x, w = rand(1, 96), rand(96, seed=3)
    norm_alone = fused.rms_norm(x, w, 1e-5)
    torch.set_num_threads(threads)
    B, L = 37, 160  # a longer buffer: keys past the position hold other data
    bq, bk, bv = rand(B, 3, 4, 32, seed=4), rand(B, 2, L, 32, seed=5), rand(B, 2, L, 33, seed=6)
    bq[21, 2], bk[21, :, :32], bv[21, :, :32] = q[0, 0], keys[0], values[0]
    bpos = torch.randint(0, L, (B, 3), generator=torch.Generator().manual_seed(7))
    bpos[21, 2] = 13
    assert torch.equal(fused.attention(bq, bk, bv, bpos, 0.17)[21, 2], alone[0, 0])
    # keys stored transposed (the fused path's KV cache) or as a strided view of fresh projections
    transposed = bk.transpose(2, 3).contiguous().transpose(2, 3)
    assert transposed.stride(2) == 1 and torch.equal(fused.attention(bq, transposed, bv, bpos, 0.17)[21, 2], alone[0, 0])
    fresh = torch.cat([bk, bk], dim=-1)[..., :32]  # row stride 64, not 32
    assert torch.equal(fused.attention(bq, fresh, bv, bpos, 0.17)[21, 2], alone[0, 0])
    bx = rand(B, 96, seed=8)
    bx[21] = x[0]
    assert torch.equal(fused.rms_norm(bx, w, 1e-5)[21], norm_alone[0])


@pytest.mark.parametrize("k, n", [(4864, 896), (896, 4864)])  # a 0.5B model's down and gate/up projections
def test_a_row_alone_is_the_same_bits_in_a_tall_tile_and_in_a_short_one_at_real_widths(k, n):
    """The fused linear cuts rows into tiles of 8 to 512 (TILE_ROWS), so a row's bits rest on MKL
    computing a row the same at every tile height. One row alone (a decode step: one 8-row tile)
    and the same row in a 520-row product, inside its 512-row tile and in the 8-row tail tile, at
    1 and 2 threads; the pure-PyTorch path (inv.linear) likewise."""
    w, x = rand(n, k, seed=1) * 0.02, rand(1, k, seed=2)
    torch.set_num_threads(1)
    alone, alone_eager = fused.linear(x, w), inv.linear(x, w, None)
    # Control: unpadded, MKL's single-row kernel gives other bits (what the padding to ROW_TILE avoids).
    big = rand(520, k, seed=3)
    big[515] = x[0]
    assert not torch.equal((x @ w.t())[0], (big @ w.t())[515])
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for pos in (0, 511, 515):  # first and last row of the 512-row tile, a row of the 8-row tail
            batch = rand(520, k, seed=3)
            batch[pos] = x[0]
            assert torch.equal(fused.linear(batch, w)[pos], alone[0]), (threads, pos)
            assert torch.equal(inv.linear(batch, w, None)[pos], alone_eager[0]), (threads, pos)


def test_gradients_match_the_pure_pytorch_ops():
    def grads(f, *inputs):
        inputs = [t.clone().requires_grad_(True) for t in inputs]
        out = f(*inputs)
        out.backward(rand(*out.shape, seed=99))
        return [t.grad for t in inputs]

    x, w = rand(6, 40), rand(40, seed=1)
    for a, b in zip(grads(lambda x, w: fused.rms_norm(x, w, 1e-6), x, w),
                    grads(lambda x, w: inv.rms_norm(x, w, 1e-6), x, w)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    gu = rand(5, 2 * 24) * 3
    torch.testing.assert_close(grads(fused.silu_mul, gu)[0],
                               grads(lambda t: inv.silu(t.chunk(2, -1)[0]) * t.chunk(2, -1)[1], gu)[0],
                               rtol=1e-5, atol=1e-5)
    qk, cos, sin = rand(2, 7, 5, 16), rand(2, 7, 16, seed=3), rand(2, 7, 16, seed=4)
    cos, ssin = inv.rope_tables(cos, sin)
    torch.testing.assert_close(grads(lambda t: fused.rope(t, cos, ssin), qk)[0],
                               grads(lambda t: inv.apply_rope(t, cos.unsqueeze(2), ssin.unsqueeze(2)), qk)[0])
    q, keys, values = rand(2, 6, 4, 8), rand(2, 2, 32, 8, seed=5), rand(2, 2, 32, 9, seed=6)
    positions = torch.tensor([list(range(6)), list(range(10, 16))])
    got = grads(lambda q, k, v: fused.attention(q, k, v, positions, 0.3), q, keys, values)
    want = grads(lambda q, k, v: eager_attention(q, k, v, positions, 0.3).float(), q, keys, values)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert not got[1][:, :, 16:].any() and not got[2][..., 8].any()  # keys nobody sees, the extra column


def test_attention_gradients_are_the_same_bits_at_any_thread_count():
    """The backward is a C++ pass over (batch, kv head) pairs in a fixed order: a training step
    reproduces exactly whatever the thread count (with keys as fresh projections or a cache)."""
    q, keys, values = rand(5, 40, 4, 16), rand(5, 2, 64, 16, seed=1), rand(5, 2, 64, 17, seed=2)
    positions = torch.arange(40).expand(5, 40) + torch.arange(5).unsqueeze(1)
    d_out = rand(5, 40, 4, 16, seed=3)
    results = []
    for threads in (1, 2, 4):
        torch.set_num_threads(threads)
        for k in (keys, keys.transpose(2, 3).contiguous().transpose(2, 3)):
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, values))
            fused.attention(qq, kk, vv, positions, 0.25).backward(d_out)
            results.append((threads, k.stride(2) == 1, qq.grad, kk.grad, vv.grad))
    for threads, transposed, *grads in results[2:]:
        reference = results[1 if transposed else 0][2:]
        assert all(torch.equal(a, b) for a, b in zip(grads, reference)), (threads, transposed)


def test_bad_shapes_are_a_clear_error_not_a_crash():
    with pytest.raises(RuntimeError, match="outside the keys"):
        fused.attention(rand(1, 1, 2, 8), rand(1, 1, 4, 8), rand(1, 1, 4, 8), torch.tensor([[4]]), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        fused.rms_norm(rand(2, 4).double(), rand(4).double(), 1e-6)
    with pytest.raises(RuntimeError, match="weight has 3 elements"):
        fused.rms_norm(rand(2, 4), rand(3), 1e-6)


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_without_a_build_the_forward_falls_back_with_a_warning_that_says_how_to_build(tmp_path, builtin_dir):
    code = f"""
        import warnings
        warnings.simplefilter("always")
        from lockstep.engine.trainer import Trainer
        t = Trainer.from_pretrained({str(builtin_dir)!r})
        print(t.model.path, "|", t.model.path_reason)
    """
    r = run_python(code, LOCKSTEP_KERNELS_DIR=str(tmp_path), LOCKSTEP_KERNELS="auto")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "eager | the fused kernels are not built"
    warning = [line for line in r.stderr.splitlines() if "fused CPU kernels are not built" in line]
    assert len(warning) == 1 and "-m lockstep.engine.kernels" in warning[0]
    r = run_python(code, LOCKSTEP_KERNELS_DIR=str(tmp_path), LOCKSTEP_KERNELS="fused")
    assert r.returncode != 0 and "LOCKSTEP_KERNELS=fused but the fused kernels are not built" in r.stderr


def test_a_failed_build_says_what_to_do_and_exits_nonzero(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lockstep.engine.kernels"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "LOCKSTEP_KERNELS_DIR": str(tmp_path), "CXX": "/nonexistent/g++"})
    assert r.returncode == 1
    assert "could not be built" in r.stderr and "Install g++ and re-run" in r.stderr


def test_keys_a_query_does_not_see_never_reach_its_gradient_even_when_they_score_high():
    """Query 0 does not see key 1 (its future); key 1 scoring far above query 0's visible key
    (its exp overflows) leaves every gradient finite and query 0's unchanged (the backward once
    took the exp before masking: inf * 0 = NaN, and training diverged within a few hundred steps)."""
    q = rand(1, 2, 2, 8)
    keys, values = rand(1, 1, 32, 8, seed=1), rand(1, 1, 32, 8, seed=2)
    positions = torch.tensor([[0, 1]])
    loud = keys.clone()
    loud[0, 0, 1] = q[0, 0, 0] * 1e3  # query 0's score for key 1: ~1e3 * |q|^2
    grads = []
    for k in (keys, loud):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, values))
        fused.attention(qq, kk, vv, positions, 0.5).sum().backward()
        assert all(torch.isfinite(g).all() for g in (qq.grad, kk.grad, vv.grad))
        grads.append(qq.grad[:, 0])
    assert torch.equal(grads[0], grads[1])


X86_CPUINFO = """processor\t: {cpu}
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 106
model name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz
cpu MHz\t\t: {mhz}
flags\t\t: fpu sse sse2 avx avx2 fma {extra}
bogomips\t: 5800.00
"""


def cpuinfo(extra: str, mhz: str = "2900.000") -> str:
    """A two-processor /proc/cpuinfo; the second processor never decides the tag."""
    return "\n".join(X86_CPUINFO.format(cpu=i, mhz=mhz, extra=extra) for i in range(2))


def test_the_build_tag_tells_apart_cpus_that_share_a_model_name_but_not_its_instruction_sets(monkeypatch):
    """A shared kernels directory across hosts: a VM that masks AVX-512 reports the same model
    name as the host that has it, and a build for the host would die with SIGILL in the VM."""
    from lockstep.engine import kernels

    def tag_for(text: str) -> str:
        monkeypatch.setattr(kernels, "_read_cpuinfo", lambda: text)
        return kernels.tag()

    with_avx512 = tag_for(cpuinfo("avx512f avx512bw avx512vl"))
    assert tag_for(cpuinfo("")) != with_avx512
    # What does not change the code the compiler emits keeps the tag (no rebuild per clock speed).
    assert tag_for(cpuinfo("avx512f avx512bw avx512vl", mhz="1200.331")) == with_avx512
