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
# gpu: Triton, whose kernels (the CUDA path) the tests run on CPU under its interpreter; pinned to the
# version whose interpreter the tests were checked with (engine/triton_kernels.py names its quirks).
.venv/bin/pip install --quiet --disable-pip-version-check "triton==3.8.0"
# dev installs the server extra too (PostgreSQL and S3 drivers); Ray is the version in
# deploy/constraints.txt, the one the image and the KubeRay manifests use.
.venv/bin/pip install --quiet --disable-pip-version-check -c deploy/constraints.txt -c scripts/constraints.txt -e ".[dev,cookbook,gpu]"
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps "tinker-cookbook==0.6.1"
# The fused CPU kernels (src/lockstep/engine/kernels/fused.cpp), compiled once for this machine
# (about a minute); g++ comes from Debian packages when missing. Without them the forward runs on
# the pure-PyTorch path, exact but slower, and says so.
if ! command -v g++ >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++) >/dev/null 2>&1 \
    || echo "setup: could not install g++; the fused kernels will not be built"
fi
.venv/bin/python -m lockstep.engine.kernels || true
# PostgreSQL, for the service's store tests (the store defaults to SQLite): installed when this
# runs as root on Debian/Ubuntu, as CI does; the tests start their own server in a temp dir.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >/dev/null 2>&1 \
    || echo "setup: could not install PostgreSQL; its tests will be skipped"
fi
# bubblewrap, the sandbox of model-written programs (the code and python_tool envs, `lockstep
# sandbox run`), and the system python3 it runs them with; without bwrap those envs refuse to start.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && { ! command -v bwrap >/dev/null || [ ! -x /usr/bin/python3 ] || ! ls /usr/lib/*/libseccomp.so.2 >/dev/null 2>&1; }; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap python3 libseccomp2) >/dev/null 2>&1 \
    || echo "setup: could not install bubblewrap; the code and python_tool envs will refuse to run"
fi
# numpy for that python3: tinker-cookbook's code_rl grader (LiveCodeBench's testing_util) imports it
# inside the sandbox (lockstep.sandbox.cookbook), where the venv's site-packages are hidden.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ -x /usr/bin/python3 ] && ! /usr/bin/python3 -c "import numpy" 2>/dev/null; then
  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-numpy) >/dev/null 2>&1 \
    || echo "setup: could not install python3-numpy; code_rl's grader will fail in the sandbox"
fi
# Chromium and its driver, for the dashboard's browser test (tests/test_dashboard.py, selenium),
# from Debian packages when this runs as root; nothing is downloaded at test time.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v chromedriver >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
    || echo "setup: could not install Chromium; the dashboard's browser test will fail (or skip without LOCKSTEP_REQUIRE_SERVICES)"
fi
echo "lockstep is set up in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
