"""Where the engine computes, and in what precision: `Compute(device, dtype)`.

CPU (the default) runs float32 on the fused C++ kernels (or the pure-PyTorch path): nothing about
it depends on this module. CUDA runs the Triton kernels of engine/triton_kernels.py in float32 or
bfloat16 (bf16 weights and activations, fp32 accumulation and fp32 logprobs). A combination the
invariant kernels do not cover is refused here, with the fix, rather than run on a path that would
silently break the sampler-trainer agreement; a CUDA request on a machine without a GPU or
without Triton is an error, never a fallback to CPU.

`kernels="triton"` on a CPU runs the Triton kernels under Triton's interpreter
(`TRITON_INTERPRET=1`): how the test suite checks the CUDA path's arithmetic without a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass

from lockstep.config.types import DEVICES, DTYPES
from lockstep.engine.types import EngineError

KERNELS = ("auto", "triton")


@dataclass(frozen=True)
class Compute:
    device: str = "cpu"
    dtype: str = "float32"
    kernels: str = "auto"
    """"auto": the device's own kernels (C++ on CPU, Triton on CUDA); "triton": the Triton kernels
    also on CPU, under the interpreter (tests)."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise EngineError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise EngineError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kernels not in KERNELS:
            raise EngineError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.dtype == "bfloat16" and not self.triton:
            raise EngineError("dtype='bfloat16' needs device='cuda': the CPU kernels are float32 only "
                              "(set model.dtype = 'float32', or run on a GPU)")

    @property
    def triton(self) -> bool:
        """Whether the forward runs the Triton kernels."""
        return self.device == "cuda" or self.kernels == "triton"

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def check(self) -> None:
        """Raise EngineError, with the fix, when this machine cannot compute this way."""
        if not self.triton:
            return
        if importlib.util.find_spec("triton") is None:
            raise EngineError(f"device={self.device!r} with the Triton kernels needs Triton, which is not installed: "
                              "pip install 'lockstep[gpu]' (or pip install triton)")
        if self.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise EngineError("kernels='triton' on a CPU runs only under Triton's interpreter: set TRITON_INTERPRET=1 "
                              "before starting the process")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise EngineError("device='cuda' but torch sees no GPU (torch.cuda.is_available() is False, torch "
                                  f"{torch.__version__}): run on a machine with an NVIDIA GPU and a CUDA build of "
                                  "torch, or set model.device = 'cpu'")

    def scope(self):
        """A context in which torch creates tensors on this device (a no-op on CPU, where a
        default-device mode would only add dispatch cost to every op)."""
        if self.device == "cpu":
            return contextlib.nullcontext()
        import torch

        return torch.device(self.device)


CPU = Compute()
