"""Batch-invariant building blocks for fp32 on CPU.

A token's result must not depend on which other rows share its batch, on padding, or on whether
it is computed in a KV-cache decode step or in a full-sequence forward. Measured on MKL (AVX2,
1 to 16 threads; see tests/test_invariant_ops.py, which re-checks every rule here):

* `mm` gives a row the same bits whatever M is, as long as M is a multiple of ROW_TILE; with M < 4,
  or a thread split that leaves a thread fewer than 4 rows, MKL takes other kernels. So every matmul
  pads its rows to a multiple of ROW_TILE.
* `bmm` with a fixed per-matrix shape is invariant to the batch count.
* `exp`, `cos`, `sin`, `log`, `sqrt` and IEEE arithmetic agree between ATen's vector and scalar
  tail paths; `sigmoid`, `silu`, `rsqrt` and `gelu` do not (up to 1 ulp), so SiLU and RMSNorm are
  composed here from the ops that agree.
* Softmax over keys is done in fixed key blocks of KEY_BLOCK, with a global max (exact in any order)
  and the per-block partial sums folded left to right in Python, so a query sees the same
  reduction tree whether its keys sit in a cache of length t or in a padded sequence of length T:
  the blocks past its position contribute exact zeros.
"""

from __future__ import annotations

import torch

ROW_TILE = 8
KEY_BLOCK = 32


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_rows(x: torch.Tensor, multiple: int = ROW_TILE) -> torch.Tensor:
    """Pad the first dim of a 2-D tensor with zero rows up to a multiple."""
    n = x.shape[0]
    target = max(round_up(n, multiple), multiple)
    if target == n:
        return x
    return torch.cat([x, x.new_zeros(target - n, *x.shape[1:])], dim=0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) with a row-invariant reduction; x is (..., in)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    n = x2.shape[0]
    out = torch.mm(pad_rows(x2), weight.t())
    if out.shape[0] != n:
        out = out[:n]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row RMSNorm; 1/sqrt instead of rsqrt, whose vector and scalar paths disagree."""
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * (1.0 / torch.sqrt(var + eps)))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), composed from exp and IEEE division (ATen's silu kernels disagree by 1 ulp)."""
    return x / (1.0 + torch.exp(-x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def blocked_attention(
    q_BHRD: torch.Tensor,
    qpos_BR: torch.Tensor,
    k_BHLD: torch.Tensor,
    v1_BHLE: torch.Tensor,
    num_blocks: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention over the first `num_blocks * KEY_BLOCK` keys, invariant to that count.

    q_BHRD: queries per KV head (rows = group heads x query positions, padded to ROW_TILE).
    qpos_BR: the absolute position of each query row; key j is visible iff j <= position.
    k_BHLD, v1_BHLE: keys and values; values carry an extra column of ones (E = D + 1) so that the
    softmax denominator comes out of the same blocked matmul as the numerator.
    Returns (B, H, R, D).
    """
    B, H, R, D = q_BHRD.shape
    L = num_blocks * KEY_BLOCK
    k = k_BHLD[:, :, :L].reshape(B, H, num_blocks, KEY_BLOCK, D)
    v = v1_BHLE[:, :, :L].reshape(B, H, num_blocks, KEY_BLOCK, D + 1)
    scores = torch.matmul(q_BHRD.unsqueeze(2), k.transpose(-1, -2)) * scale  # (B,H,nb,R,KB)
    keys = torch.arange(L, device=q_BHRD.device).view(num_blocks, 1, KEY_BLOCK)
    visible = keys <= qpos_BR.view(B, 1, 1, R, 1)
    scores = scores.masked_fill(~visible, float("-inf"))
    m = scores.amax(dim=(2, 4), keepdim=True)
    partial = torch.matmul(torch.exp(scores - m), v)  # (B,H,nb,R,D+1)
    acc = partial[:, :, 0]
    for b in range(1, num_blocks):
        acc = acc + partial[:, :, b]
    return acc[..., :D] / acc[..., D:]


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise log-softmax (ATen's last-dim reductions are row-invariant; tested)."""
    return torch.log_softmax(logits, dim=-1)
