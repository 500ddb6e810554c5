"""Batch-invariant building blocks for fp32 on CPU.

A token's result must not depend on which other rows share its batch, on padding, or on whether
it is computed in a KV-cache decode step or in a full-sequence forward. The rules, re-checked by
tests/test_invariant_ops.py:

* MKL runs in strict CNR mode (`MKL_CBWR=AUTO,STRICT`, set by `require_strict_mkl()` at import).
  Without it MKL picks sgemm kernels and K-splits by M and thread count, and those choices differ
  between CPUs: on AVX2 (EPYC) rows matched for M a multiple of 8, but on AVX-512 (Xeon) rows of
  M = 8 and M >= 16 differ once K >= 256, and at 2 threads M = 16 and M = 64 differ for K >= 1024.
  Strict mode fixes the reduction order per output element, at no measured speed cost here
  (2048 x 512 x 128 sgemm: 322 vs 325 GFLOP/s).
* `mm` then gives a row the same bits whatever M and the thread count; every matmul still pads
  its rows to a multiple of ROW_TILE, which batched matmuls need (with R = 1 or 2 rows per
  matrix, bmm takes another kernel even in strict mode).
* `bmm` with a fixed per-matrix shape is invariant to the batch count.
* `exp`, `cos`, `sin`, `log`, `sqrt` and IEEE arithmetic agree between ATen's vector and scalar
  tail paths; `sigmoid`, `silu`, `rsqrt` and `gelu` do not (up to 1 ulp), so SiLU and RMSNorm are
  composed here from the ops that agree.
* Attention runs over a key length L padded to a multiple of KEY_BLOCK. With L a multiple of 32,
  a score column comes out the same whatever L is, and a P @ V row the same whatever number of
  trailing zero probabilities it carries (checked up to L = 1024), so a query sees the same bits
  whether its keys sit in a cache of length t or in a padded sequence of length T. Longer key
  ranges are cut into segments of KEY_SEGMENT whose partial sums are folded left to right.
"""

from __future__ import annotations

import ctypes
import glob
import os
import warnings

import torch

MKL_CBWR_AUTO, MKL_CBWR_STRICT, MKL_CBWR_ALL = 2, 0x10000, -1


def _mkl():
    """MKL's service functions inside libtorch, or None when torch is not built with MKL."""
    if not torch.backends.mkl.is_available():
        return None
    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.*")):
        try:
            lib = ctypes.CDLL(path)
            get, set_ = lib.mkl_serv_cbwr_get, lib.mkl_serv_cbwr_set
        except (OSError, AttributeError):
            continue
        get.argtypes, get.restype, set_.argtypes, set_.restype = [ctypes.c_int], ctypes.c_int, [ctypes.c_int], ctypes.c_int
        return lib
    return None


def require_strict_mkl() -> str:
    """Put MKL in strict CNR mode (see the module docstring); returns the mode in effect.

    MKL only accepts a mode before its first call, so this runs when the engine is imported; the
    environment variable carries the mode into child processes (Ray workers). If MKL was already
    used in this process in another mode, sampler and trainer may disagree: warn, loudly.
    """
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
    lib = _mkl()
    if lib is None:
        return "no-mkl"
    _fixed_thread_count(lib)
    if lib.mkl_serv_cbwr_get(MKL_CBWR_ALL) & MKL_CBWR_STRICT or lib.mkl_serv_cbwr_set(MKL_CBWR_AUTO | MKL_CBWR_STRICT) == 0:
        return "strict"
    warnings.warn("MKL is not in strict CNR mode (it was used before lockstep was imported, with MKL_CBWR unset or "
                  "not STRICT): sampler and trainer logprobs may differ in the last bits. Set MKL_CBWR=AUTO,STRICT "
                  "in the environment, or import lockstep before running any torch matmul.", RuntimeWarning, stacklevel=2)
    return "not-strict"


def _fixed_thread_count(lib) -> None:
    """MKL_DYNAMIC off: by default MKL may run a call on fewer threads than asked when the machine
    is busy, and a product's reduction order follows its thread count, so the same training step
    gave other bits in 1-2 fresh processes of 10 on a shared machine. Set here and, through the
    environment, in child processes (Ray workers)."""
    os.environ.setdefault("MKL_DYNAMIC", "FALSE")
    fn = getattr(lib, "MKL_Set_Dynamic", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_int], None
        fn(0)


MKL_MODE = require_strict_mkl()


class _mkl_single_thread:
    """MKL on one thread for this thread's calls inside the block: at 3+ threads MKL changes the
    reduction order of small products even in strict CNR mode (a rank-8 LoRA's (8 x 8) @ (8 x 32)
    at 4 threads), and MKL_DYNAMIC may give a call fewer threads than asked when the machine is
    busy. Only the pure-PyTorch fallback needs this; the fused kernels' linear has a fixed plan."""

    _set = None

    def __enter__(self):
        if _mkl_single_thread._set is None:
            lib = _mkl()
            fn = getattr(lib, "MKL_Set_Num_Threads_Local", None) if lib is not None else None
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            _mkl_single_thread._set = fn or False
        self.before = _mkl_single_thread._set(1) if _mkl_single_thread._set else None

    def __exit__(self, *exc):
        if self.before is not None:
            _mkl_single_thread._set(self.before)

ROW_TILE = 8
KEY_BLOCK = 32
KEY_SEGMENT = 1024


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
    """x @ weight.T (+ bias) with a row-invariant reduction; x is (..., in). With the fused
    kernels built, through their fixed tile plan (invariant to the thread count, forward and
    backward); else one padded `mm`."""
    if _fixed_plan_linear is not None:
        return _fixed_plan_linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    n = x2.shape[0]
    with _mkl_single_thread():
        out = torch.mm(pad_rows(x2), weight.t())
    if out.shape[0] != n:
        out = out[:n]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def _fused_ops():
    """(linear, log_softmax) of the fused kernels, or (None, None) when they are not built."""
    from lockstep.engine import kernels

    if kernels.load() is None:
        return None, None
    from lockstep.engine import fused

    return fused.linear, fused.log_softmax


_fixed_plan_linear, _fused_log_softmax = _fused_ops()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row RMSNorm; 1/sqrt instead of rsqrt, whose vector and scalar paths disagree."""
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * (1.0 / torch.sqrt(var + eps)))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), composed from exp and IEEE division (ATen's silu kernels disagree by 1 ulp)."""
    return x / (1.0 + torch.exp(-x))


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) so that apply_rope is x*cos + roll(x)*signed_sin.

    HF's rotate_half(x) * sin is cat(-x2, x1) * cat(s, s) = cat(x2, x1) * cat(-s, s), bit for bit
    (negation is exact), in two fewer ops per call.
    """
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def attention(
    q_BHRD: torch.Tensor,
    k_BHLD: torch.Tensor,
    v1_BHLE: torch.Tensor,
    bias_B1RL: torch.Tensor,
) -> torch.Tensor:
    """Softmax attention over L keys (L a multiple of KEY_BLOCK), invariant to L past the visible keys.

    q_BHRD: pre-scaled queries per KV head (rows = group heads x positions, padded to ROW_TILE).
    k_BHLD, v1_BHLE: keys and values; values carry a trailing column of ones (E = D + 1), so the
    softmax denominator comes out of the same matmul as the numerator.
    bias_B1RL: 0 where a key is visible to a query row, -inf where not (at least one 0 per row).
    Keys are taken in segments of KEY_SEGMENT whose partial results are folded left to right.
    Returns (B, H, R, D).
    """
    L = k_BHLD.shape[2]
    scores = torch.matmul(q_BHRD, k_BHLD.transpose(-1, -2)) + bias_B1RL
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # a max is exact in any order
    acc = None
    for start in range(0, L, KEY_SEGMENT):
        part = torch.matmul(p[..., start : start + KEY_SEGMENT], v1_BHLE[:, :, start : start + KEY_SEGMENT])
        acc = part if acc is None else acc + part
    D = q_BHRD.shape[-1]
    return acc[..., :D] / acc[..., D:]


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise log-softmax: the fused kernel when built, else ATen's (its last-dim reductions are
    row-invariant; tested). Sampler and trainer both come here."""
    if _fused_log_softmax is not None:
        return _fused_log_softmax(logits)
    return torch.log_softmax(logits, dim=-1)
