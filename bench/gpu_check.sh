#!/usr/bin/env bash
# The CUDA path's device check (bench/gpu_check.py; BENCHMARKS.md §19): one script, at most 8
# minutes on one H200 or H100. Run it from the repository root on the GPU machine:
#   bash bench/gpu_check.sh [OUT_DIR]        (default: $OUT, else bench/results)
# It needs python3 with torch (CUDA), triton, transformers, peft, safetensors and numpy: the device
# image has them. A package it lacks travels as wheels in .whl/ (see the device tool's README),
# installed here into /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-bench/results}}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false LOCKSTEP_KERNELS=eager  # the CPU kernels are not built there
nvidia-smi -L || true
python3 -c "import torch, triton, transformers, peft, safetensors, numpy; print('imports ok: torch', torch.__version__)"
set -o pipefail
timeout 470 python3 bench/gpu_check.py --out "$OUT/gpu_check.json" "${@:2}" 2>&1 | tee "$OUT/gpu_check.log"
