"""Runs N optimizer steps in a fresh process, optionally from / to a saved state (see test_state)."""

import argparse

import numpy as np
from safetensors.numpy import save_file

from lockstep.engine.trainer import Trainer
from lockstep.engine.types import AdamParams, Datum, LoraSpec


def batch(step: int):
    """4 datums of their own and a group of 4 sharing a prompt (the trainer's shared-prefix path)."""
    rng = np.random.default_rng(1000 + step)
    prompt = rng.integers(4, 260, 12).tolist()
    return ([Datum.from_tokens(rng.integers(4, 260, 16 + 5 * i).tolist()) for i in range(4)]
            + [Datum.from_tokens(prompt + rng.integers(4, 260, 6).tolist()) for _ in range(4)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--load")
    ap.add_argument("--save")
    ap.add_argument("--weights-out", required=True)
    a = ap.parse_args()
    if a.load:
        trainer = Trainer.from_state(a.load)
    else:
        trainer = Trainer.from_pretrained(a.model, lora=LoraSpec(rank=4, seed=7) if a.lora else None)
    start = trainer.data_position or 0
    for step in range(start, start + a.steps):
        trainer.forward_backward(batch(step), "cross_entropy")
        trainer.optim_step(AdamParams(learning_rate=2e-3, weight_decay=0.01, grad_clip_norm=1.0))
    if a.save:
        trainer.save_state(a.save, data_position=start + a.steps)
    save_file(trainer.weights_numpy(), a.weights_out)


if __name__ == "__main__":
    main()
