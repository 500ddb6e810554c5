"""One rank of a data-parallel trainer (see test_data_parallel): steps over fixed micro-batches."""

import argparse
import json
import sys

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


def fail_on(trainer: Trainer, part) -> None:
    """Make this rank's forward_backward raise a RuntimeError (an internal error, not an
    EngineError) on the micro-batch `part`."""
    real = type(trainer).forward_backward.__get__(trainer)

    def forward_backward(data, *args, **kwargs):
        if data is part:
            raise RuntimeError("injected: an internal error on this rank")
        return real(data, *args, **kwargs)

    trainer.forward_backward = forward_backward


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
    ap.add_argument("--fail-rank", type=int, help="the rank that raises RuntimeError on --fail-micro in the first step; "
                                                  "every rank reports a failed step, goes on, and exits when stdin closes")
    ap.add_argument("--fail-micro", type=int)
    a = ap.parse_args()
    init_group(a.rank, a.world, "127.0.0.1", a.port)
    trainer = Trainer.from_state(a.load) if a.load else Trainer.from_pretrained(a.model)
    dp = DataParallel(trainer)
    start = trainer.data_position or 0
    if a.fail_rank is not None:  # every rank started and loaded: step when the test says so
        print(json.dumps({"ready": a.rank}), flush=True)
        sys.stdin.readline()
    for step in range(start, start + a.steps):
        parts = micro_batches(step, a.micro)
        if a.fail_rank == a.rank:
            fail_on(trainer, parts[a.fail_micro] if step == start else None)
        try:
            dp.forward_backward(parts, "cross_entropy")
        except Exception as e:  # a trainer actor lives on after a failed step: so does this rank
            if a.fail_rank is None:
                raise
            print(json.dumps({"rank": a.rank, "step": step, "error": type(e).__name__, "message": str(e)}), flush=True)
            continue
        dp.optim_step(ADAM)
    if a.save and a.rank == 0:  # every rank holds the same state: one writes the run's checkpoint
        trainer.save_state(a.save, data_position=start + a.steps)
    save_file(trainer.weights_numpy(), a.weights_out)
    if a.fail_rank is not None:  # a failed rank's process lives on, as a trainer actor's does
        sys.stdin.read()  # until the test closes stdin: exiting would close this rank's connections


if __name__ == "__main__":
    main()
