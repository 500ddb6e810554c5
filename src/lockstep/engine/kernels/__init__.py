"""The fused CPU kernels (fused.cpp; stack.cpp: the decoder stack in one call; lora.cpp: many LoRA adapters,
one per row, over a shared base): built once by `scripts/setup.sh`, loaded here, or the pure-PyTorch path
with a warning.

`python -m lockstep.engine.kernels` compiles the sources through torch's C++ extension machinery
into `_build/<tag>/` next to this file; the tag hashes the sources, the compile flags, the torch
version and the CPU (model and instruction-set flags), so an edited source, another torch or a CPU
without an instruction the build uses is never served a stale build. Loading never
compiles (a first forward must not wait a minute for g++, once per Ray worker): a missing build
means the fallback.

`LOCKSTEP_KERNELS=eager` forces the pure-PyTorch path (tests compare the two); `=fused` makes a
missing build an error instead of a fallback. `LOCKSTEP_KERNELS_DIR` moves the builds elsewhere.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).parent
SOURCES = (HERE / "fused.cpp", HERE / "stack.cpp", HERE / "lora.cpp")
HEADERS = (HERE / "fused.h", HERE / "lora.h")
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-std=c++17", "-fopenmp")
"""-ffp-contract=off and no fast-math: see THE RULE at the top of fused.cpp. -march=native: the
build runs on the machine that uses it (setup.sh); another CPU gets its own build. -fopenmp: ATen's
parallel_for is an inline OpenMP loop, serial without it (the process then shares torch's own
libgomp.so.1, loaded first)."""
LDFLAGS = ("-fopenmp",)
MODE_ENV = "LOCKSTEP_KERNELS"

_loaded: ModuleType | None = None
_tried = False


def tag() -> str:
    """Which build serves this source, these compile flags, this torch and this CPU (model and ISA flags)."""
    h = hashlib.sha256()
    for path in SOURCES + HEADERS:
        h.update(path.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_identity().encode())
    return h.hexdigest()[:16]


CPU_KEYS = ("vendor_id", "cpu family", "model", "model name", "flags",
            "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")
"""The /proc/cpuinfo fields that decide what -march=native emits: the model (x86's name, family and
model; ARM's implementer and part) and the instruction sets (x86's flags, ARM's Features). Two hosts
that share a model name can differ in flags (a VM that masks AVX-512, another microcode): a build
for one would die with SIGILL on the other, so both are hashed."""


def _cpu_identity() -> str:
    """The CPU_KEYS lines of the first processor, or "unknown" when /proc/cpuinfo is unreadable."""
    try:
        text = _read_cpuinfo()
    except OSError:
        return "unknown"
    first = text.split("\n\n", 1)[0]
    fields = {}
    for line in first.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in CPU_KEYS:
            fields[key.strip()] = value.strip()
    return "\n".join(f"{k}: {fields[k]}" for k in CPU_KEYS if k in fields) or "unknown"


def _read_cpuinfo() -> str:
    return Path("/proc/cpuinfo").read_text()


DIR_ENV = "LOCKSTEP_KERNELS_DIR"
"""Where builds live, if not next to this file (an install that cannot write there)."""


def build_dir() -> Path:
    root = os.environ.get(DIR_ENV)
    return (Path(root) if root else Path(__file__).with_name("_build")) / tag()


def module_name() -> str:
    return f"lockstep_fused_{tag()}"


def build(verbose: bool = False) -> Path:
    """Compile the sources (a minute on 2 cores); returns the shared library's path."""
    from torch.utils.cpp_extension import load

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    load(name=module_name(), sources=[str(p) for p in SOURCES], extra_include_paths=[str(HERE)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
         build_directory=str(out), verbose=verbose)
    return _library(out)


def _library(out: Path) -> Path:
    found = sorted(out.glob(f"{module_name()}*.so"))
    if not found:
        raise FileNotFoundError(f"no {module_name()}*.so in {out}")
    return found[0]


def load() -> ModuleType | None:
    """The built kernels, or None (the pure-PyTorch path) with a one-time warning saying why."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    mode = os.environ.get(MODE_ENV, "auto")
    if mode == "eager":
        return None
    try:
        path = _library(build_dir())
        spec = importlib.util.spec_from_file_location(module_name(), path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded = module
    except (OSError, ImportError) as e:
        if mode == "fused":
            raise RuntimeError(f"{MODE_ENV}=fused but the fused kernels are not built for this source, torch and "
                               f"CPU ({e}); build them with: {sys.executable} -m lockstep.engine.kernels") from e
        warnings.warn(f"lockstep's fused CPU kernels are not built, so the forward runs on the slower pure-PyTorch "
                      f"path (still exact). To build them (needs g++): {sys.executable} -m lockstep.engine.kernels",
                      RuntimeWarning, stacklevel=2)
    return _loaded

