"""A component's forward fingerprint (engine/types.py ForwardFingerprint): what decides its bits.

The sampler's logprobs equal the trainer's bit for bit only when both run the same arithmetic.
Nothing guarantees that across processes on other machines: a node without the fused build
falls back to the eager path (engine/kernels load()), MKL and ATen pick their code by the CPU's
instruction set, glibc picks its libm variant the same way. Every actor that runs the model
(trainer ranks, generator replicas) computes its fingerprint once, after loading the model, and
the controller compares them with the trainer's (runtime/controller.py).

`probe` measures rather than declares: the logprobs of a fixed forward through the loaded model,
hashed. Components that load the same weights and compute alike give the same hash; a cause no
field names (another MKL build inside the same torch version, a libm patch) still shows there.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
from pathlib import Path

import torch

from lockstep.engine.types import ForwardFingerprint

RESULT_ISA = frozenset({
    # MKL's CNR AUTO branch ladder (MKL_CBWR=AUTO,STRICT fixes the order within a branch, not
    # across branches): SSE4_2 -> AVX -> AVX2 (which needs FMA) -> AVX512 (F, CD, BW, DQ, VL) ->
    # AVX512_E1 (VNNI); the BF16/AMX/FP16 levels select oneDNN's bf16 kernels and MKL's newest
    # branches. The fused kernels' matrix products are MKL sgemm calls, so these matter there too.
    "sse4_2", "avx", "avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
    # glibc's libm picks FMA (and AMD's FMA4) variants of exp, log, pow, sin, cos by ifunc; the
    # fused kernels call logf and exp, the eager path's scalar tails call them too.
    "fma4",
    # aarch64: ATen's SVE kernels and the BF16/I8MM matmul paths.
    "asimd", "sve", "sve2", "bf16", "i8mm",
})
"""CPU flags (as /proc/cpuinfo names them) that select another code path in MKL, ATen or libm.
Flags that only speed up what is computed the same way (aes, bmi2, popcnt, ...) are left out, so
that two CPUs that compute alike are not refused for them."""

PROBE_TOKENS = 16
"""Tokens of the probe forward: two row tiles, enough to run every kernel of the model."""

_MKL_BRANCHES = {2: "not an Intel CPU", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX",
                 10: "AVX2", 12: "AVX512", 14: "AVX512_E1"}
"""MKL_CBWR branch codes (mkl_cbwr.h) -> names, for mkl_serv_cbwr_get_auto_branch."""


def forward_fingerprint(model) -> ForwardFingerprint:
    """The fingerprint of `model` (an InvariantLM) as loaded in this process. Call it before the
    model is given other weights: the probe assumes every component hashes the same weights."""
    from lockstep.engine import kernels

    cpu = model.compute.device == "cpu"
    return ForwardFingerprint(
        path=model.path, kernel_build=kernels.tag() if model.path == "fused" else "",
        device=_device(model.compute.device), dtype=model.compute.dtype, isa=cpu_isa() if cpu else (),
        aten_cpu=torch.backends.cpu.get_cpu_capability() if cpu else "", mkl=mkl_state() if cpu else "",
        matmul_precision=_matmul_precision(), libraries=_libraries(model.path == "triton"), probe=probe(model))


def probe(model) -> str:
    """sha256 (16 hex digits) of every logprob of a fixed PROBE_TOKENS forward.

    Under autograd, as the trainer computes (the sampler's no-grad forward gives the same bits:
    tests/test_models.py), so that no caches of fused weights are built for it on the trainer."""
    vocab = model.config.vocab_size
    tokens_BT = torch.tensor([[(7 * i + 3) % vocab for i in range(PROBE_TOKENS)]])
    with torch.enable_grad(), model.compute.scope():
        logp = model.log_softmax(model.logits(model.hidden_states(tokens_BT)))
    return hashlib.sha256(logp.detach().float().cpu().numpy().tobytes()).hexdigest()[:16]


def cpu_isa(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The RESULT_ISA flags (sorted) of this CPU, or of the CPU `cpuinfo` (/proc/cpuinfo's text)
    describes: its first "flags" (x86) or "Features" (aarch64) line."""
    line = re.search(r"^(?:flags|Features)\s*:(.*)$", _cpuinfo() if cpuinfo is None else cpuinfo, re.MULTILINE)
    return tuple(sorted(RESULT_ISA & set(line.group(1).split()))) if line else ()


def mkl_state() -> str:
    """MKL's version, CNR mode and the branch it picks here; "none" when torch has no MKL."""
    from lockstep.engine import invariant

    lib = invariant._mkl()  # the MKL inside libtorch, as invariant.py sets it up
    if lib is None:
        return "none"
    buf = ctypes.create_string_buffer(256)
    get_version = getattr(lib, "mkl_serv_get_version_string", None)
    if get_version is not None:
        get_version(buf, len(buf))
    found = re.search(r"Version ([\d.]+).*?Build (\d+)", buf.value.decode(errors="replace"))
    version = f"{found.group(1)} (build {found.group(2)})" if found else "?"
    branch = getattr(lib, "mkl_serv_cbwr_get_auto_branch", None)
    if branch is not None:
        branch.restype = ctypes.c_int
        code = branch()
        branch = _MKL_BRANCHES.get(code, str(code))
    out = f"{version}, CNR {invariant.MKL_MODE}, branch {branch}"
    limit = os.environ.get("MKL_ENABLE_INSTRUCTIONS")  # caps the branch below what the CPU has
    return f"{out}, MKL_ENABLE_INSTRUCTIONS={limit}" if limit else out


def _device(device: str) -> str:
    if device == "cuda":
        i = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(i)
        return f"cuda: {torch.cuda.get_device_name(i)}, sm_{major}{minor}"
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", _cpuinfo(), re.MULTILINE)
    return f"cpu ({platform.machine()}{', ' + vendor.group(1) if vendor else ''})"


def _cpuinfo() -> str:
    """/proc/cpuinfo; "" where there is none (not Linux: `device` still names the machine type)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _matmul_precision() -> str:
    out = torch.get_float32_matmul_precision()
    mkldnn = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", None)
    return f"{out}, oneDNN {mkldnn}" if mkldnn is not None else out


def _libraries(triton: bool) -> str:
    libc, version = platform.libc_ver()
    out = f"torch {torch.__version__}, {libc or 'libc'} {version or '?'}"
    if triton:
        import triton as triton_module

        out += f", triton {triton_module.__version__}, cuda {torch.version.cuda}"
    return out
