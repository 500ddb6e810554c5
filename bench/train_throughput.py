"""Train-step tokens/s and achieved FLOP/s against this machine's measured fp32 matmul peak.

    .venv/bin/python bench/train_throughput.py [--sizes builtin,5M,20M] [--repeats 3]

A step is Trainer.forward_backward (cross_entropy, 32 x 128 tokens) + optim_step, full fine-tuning.
FLOPs per step are counted as 6 x (matmul parameters) x tokens plus attention (4 x layers x T x
hidden per token, forward; x3 with backward). The peak is the best of a few 2048^3 sgemms.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

sys.path.insert(0, "bench")
from common import emit, median, model_dir, timed  # noqa: E402

from lockstep.engine.trainer import Trainer  # noqa: E402
from lockstep.engine.types import AdamParams, Datum  # noqa: E402

B, T = 32, 128


def matmul_peak() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = min(timed(lambda: a @ b, 5))
    return 2 * 2048**3 / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="builtin,5M,20M")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    peak = matmul_peak()
    rows = []
    for size in args.sizes.split(","):
        trainer = Trainer.from_pretrained(model_dir(size))
        cfg = trainer.model.config
        rng = np.random.default_rng(0)
        data = [Datum.from_tokens(rng.integers(4, cfg.vocab_size, T + 1).tolist()) for _ in range(B)]

        def step():
            trainer.forward_backward(data, "cross_entropy")
            trainer.optim_step(AdamParams(learning_rate=1e-4))

        step()
        t = median(timed(step, args.repeats))
        matmul_params = sum(p.numel() for n, p in trainer.hf_model.named_parameters() if p.dim() == 2 and "embed" not in n)
        matmul_params += cfg.vocab_size * cfg.hidden_size  # tied lm_head
        tokens = B * T
        flops = 6 * matmul_params * tokens + 3 * 4 * cfg.num_hidden_layers * T * cfg.hidden_size * tokens
        rows.append({"model": size, "params_M": sum(p.numel() for p in trainer.params.values()) / 1e6,
                     "step_s": t, "tokens_per_s": tokens / t, "achieved_GFLOP_s": flops / t / 1e9,
                     "peak_GFLOP_s": peak / 1e9, "fraction_of_peak": flops / t / peak})
    emit("train_throughput", rows, {"batch": B, "seq_len": T})


if __name__ == "__main__":
    main()
