"""The numerical facts the invariant forward relies on, re-checked on this machine's torch/MKL.

If one of these fails on a new platform, the invariant forward is not bitwise there; the
consistency check would show it too, but this names the broken rule.
"""

import torch

from lockstep.engine import invariant as inv


def _row_of(fn, x, M, pos):
    A = torch.randn(M, x.shape[0])
    A[pos] = x
    return fn(A)[pos]


def test_mkl_runs_in_strict_cnr_mode():
    """The engine put MKL in strict CNR mode before its first call (see engine/invariant.py)."""
    assert inv.MKL_MODE in ("strict", "no-mkl")
    if inv.MKL_MODE == "strict":
        assert inv._mkl().mkl_serv_cbwr_get(inv.MKL_CBWR_ALL) & inv.MKL_CBWR_STRICT


def test_linear_rows_invariant_to_batch_and_threads():
    torch.manual_seed(0)
    # Reductions of 64 to 2048: without strict CNR, AVX-512 MKL splits K >= 256 differently by M.
    for n_out, n_in in ((96, 64), (128, 512), (512, 2048)):
        W, b = torch.randn(n_out, n_in), torch.randn(n_out)
        x = torch.randn(n_in)
        outs = []
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            for M in (1, 2, 3, 7, 8, 9, 16, 31, 64, 208, 257):
                for pos in {0, M // 2, M - 1}:
                    outs.append(_row_of(lambda A: inv.linear(A, W, b), x, M, pos))
        assert all(torch.equal(o, outs[0]) for o in outs), (n_out, n_in)


def test_batched_matmul_is_not_row_invariant_without_padding():
    """Why rows are padded to ROW_TILE: a batched matmul with 1 row per matrix takes another
    kernel than one with 8 (attention runs per KV head on a few query rows in decode)."""
    torch.manual_seed(0)
    V, x = torch.randn(2, 2, 64, 33), torch.randn(64)
    single = torch.matmul(x.expand(2, 2, 1, 64).contiguous(), V)[1, 0, 0]
    P = torch.randn(2, 2, inv.ROW_TILE, 64)
    P[1, 0, 3] = x
    assert not torch.equal(single, torch.matmul(P, V)[1, 0, 3])


def test_composed_silu_and_rmsnorm_agree_between_vector_and_scalar_paths():
    torch.manual_seed(0)
    x = torch.randn(4099) * 4
    full = inv.silu(x)
    pieces = torch.cat([inv.silu(x[i : i + 3]) for i in range(0, 4099, 3)])
    assert torch.equal(full, pieces)
    w = torch.randn(64)
    rows = torch.randn(37, 64)
    norm = inv.rms_norm(rows, w, 1e-6)
    assert all(torch.equal(norm[i], inv.rms_norm(rows[i : i + 1], w, 1e-6)[0]) for i in range(37))


def test_attention_invariant_to_key_length_past_visible_keys():
    torch.manual_seed(0)
    B, H, R, D = 3, 2, 8, 16
    q = torch.randn(B, H, R, D)
    k, v = torch.randn(B, H, 512, D), torch.randn(B, H, 512, D + 1)
    qpos = torch.randint(0, 40, (B, R))
    outs = []
    for L in (64, 96, 256, 512):
        hidden = torch.arange(L).view(1, 1, 1, L) > qpos.view(B, 1, R, 1)
        bias = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
        outs.append(inv.attention(q, k[:, :, :L], v[:, :, :L], bias))
    assert all(torch.equal(o, outs[0]) for o in outs)
