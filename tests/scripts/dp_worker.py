"""One rank of a data-parallel trainer (see test_data_parallel): steps over fixed micro-batches."""

import argparse

from safetensors.numpy import save_file

from lockstep.engine.data_parallel import DataParallel, init_group
from lockstep.engine.trainer import Trainer
from lockstep.engine.types import AdamParams, Datum

ADAM = AdamParams(learning_rate=2e-3, weight_decay=0.01, grad_clip_norm=1.0)


def micro_batches(step: int, count: int) -> list[list[Datum]]:
    """`count` micro-batches of 3 datums of different lengths, a pure function of the step."""
    import numpy as np

    rng = np.random.default_rng(5000 + step)
    return [[Datum.from_tokens(rng.integers(4, 260, 10 + 7 * j + 3 * m).tolist()) for j in range(3)]
            for m in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--micro", type=int, required=True)
    ap.add_argument("--load")
    ap.add_argument("--save")
    ap.add_argument("--weights-out", required=True)
    a = ap.parse_args()
    init_group(a.rank, a.world, "127.0.0.1", a.port)
    trainer = Trainer.from_state(a.load) if a.load else Trainer.from_pretrained(a.model)
    dp = DataParallel(trainer)
    start = trainer.data_position or 0
    for step in range(start, start + a.steps):
        dp.forward_backward(micro_batches(step, a.micro), "cross_entropy")
        dp.optim_step(ADAM)
    if a.save and a.rank == 0:  # every rank holds the same state: one writes the run's checkpoint
        trainer.save_state(a.save, data_position=start + a.steps)
    save_file(trainer.weights_numpy(), a.weights_out)


if __name__ == "__main__":
    main()
