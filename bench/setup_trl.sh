#!/usr/bin/env bash
# Build bench/.venv-trl: the virtual environment for bench/trl_grpo.py (the TRL GRPOTrainer side
# of the lockstep-vs-TRL GRPO benchmark). Idempotent: does nothing when the venv already imports trl
# at the pinned version.
#
# torch is installed FIRST and on its own: the 2.13.0 CPU wheel lies on local disk, and installing
# it before trl keeps pip from resolving torch itself (which would pull a multi-GB CUDA build).
# transformers is pinned to the version lockstep's own venv uses, so both sides run the same model
# code; the project itself is NOT installed here — trl_grpo.py imports only
# lockstep.envs.arithmetic (pure Python) from <repo>/src via sys.path.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv-trl"
PY="${PYTHON:-python3}"

TORCH_VERSION="2.13.0"
TRL_VERSION="1.16.0"
TRANSFORMERS_VERSION="5.24.0"
ACCELERATE_VERSION="1.16.0"
DATASETS_VERSION="5.2.0"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$TRL_VERSION" <<'EOF' 2>/dev/null; then
import sys, trl
sys.exit(0 if trl.__version__ == sys.argv[1] else 1)
EOF
    echo "setup_trl: $VENV already has trl==$TRL_VERSION; nothing to do"
    exit 0
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

# 1. torch, alone (CPU wheel from local disk).
"${PIP[@]}" "torch==$TORCH_VERSION"
# 2. trl and the Hugging Face stack it needs; torch is already satisfied so pip leaves it alone.
"${PIP[@]}" "torch==$TORCH_VERSION" "trl==$TRL_VERSION" "transformers==$TRANSFORMERS_VERSION" \
    "accelerate==$ACCELERATE_VERSION" "datasets==$DATASETS_VERSION"

"$VENV/bin/python" - <<'EOF'
import torch, transformers, trl, accelerate, datasets
print(f"setup_trl: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"trl {trl.__version__}, accelerate {accelerate.__version__}, datasets {datasets.__version__}, "
      f"cuda {torch.version.cuda}")
EOF
echo "setup_trl: done in $(( $(date +%s) - start )) s"
