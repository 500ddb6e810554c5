"""Cost of the batch-invariant path against the plain transformers path, side by side.

    .venv/bin/python bench/invariant_overhead.py [--sizes builtin,20M] [--repeats 5]

Same weights, same batch (32 sequences x 128 tokens): a training step's forward+backward of the
summed cross-entropy through lockstep's invariant forward, against the model's own transformers
forward (SDPA attention); and a no-grad forward of the same batch (the prefill shape).
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "bench")
from common import emit, median, model_dir, timed  # noqa: E402

from lockstep.engine.loading import load_model  # noqa: E402
from lockstep.engine.model import InvariantLM  # noqa: E402

B, T = 32, 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="builtin,20M")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for size in args.sizes.split(","):
        hf, _ = load_model(model_dir(size))
        hf.config._attn_implementation = "sdpa"
        ours = InvariantLM(hf)
        tokens = torch.randint(4, hf.config.vocab_size, (B, T + 1))
        inp, tgt = tokens[:, :-1], tokens[:, 1:]

        def ours_loss():
            lp = ours.logprobs_of(ours.hidden_states(inp), tgt)
            return -lp.sum()

        def plain_loss():
            logits = hf(input_ids=inp).logits
            return -torch.log_softmax(logits, -1).gather(-1, tgt.unsqueeze(-1)).sum()

        def step(loss_fn):
            def run():
                hf.zero_grad(set_to_none=True)
                loss_fn().backward()
            return run

        def fwd(loss_fn):
            def run():
                with torch.no_grad():
                    loss_fn()
            return run

        fns = {"train_ours": step(ours_loss), "train_plain": step(plain_loss),
               "fwd_ours": fwd(ours_loss), "fwd_plain": fwd(plain_loss)}
        for f in fns.values():
            f()
        times = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, f in fns.items():
                times[k] += timed(f, 1)
        m = {k: median(v) for k, v in times.items()}
        rows.append({"model": size, "train_step_invariant_s": m["train_ours"], "train_step_plain_s": m["train_plain"],
                     "train_ratio": m["train_ours"] / m["train_plain"], "forward_invariant_s": m["fwd_ours"],
                     "forward_plain_s": m["fwd_plain"], "forward_ratio": m["fwd_ours"] / m["fwd_plain"]})
    emit("invariant_overhead", rows, {"batch": B, "seq_len": T})


if __name__ == "__main__":
    main()
