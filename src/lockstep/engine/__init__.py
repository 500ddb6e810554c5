"""The engine: model loading, the batch-invariant forward, sampler, trainer, LoRA, checkpoints.

Importing it (before any engine module touches torch) puts MKL in strict CNR mode, which the
invariant forward needs on every CPU (see engine/invariant.py); torch-free, so that processes
which only read engine/types.py never import torch.
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
