#!/usr/bin/env bash
# Set up .venv for lockstep on a CPU machine: the CPU build of torch first (from local disk when
# available), then lockstep itself with its test extras. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# Pin the CPU wheel before anything that depends on torch, or pip pulls a multi-GB CUDA build.
.venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[dev]"
echo "lockstep is set up in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
