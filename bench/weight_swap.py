"""Latency from weight publish until the weights are visible in the generator, by model size.

    .venv/bin/python bench/weight_swap.py [--sizes builtin,20M,100M] [--repeats 5]

On one Ray node: the TrainerActor puts its weights (NumPy, one array per parameter) in the object
store; the driver hands the ObjectRef to the GeneratorActor, which maps the arrays zero-copy and
swaps its parameters to them. Reported: publish (trainer -> object store), and publish-to-visible
(from the moment the driver has the ref until the generator has swapped), medians.
"""

from __future__ import annotations

import argparse
import sys
import time

import ray

sys.path.insert(0, "bench")
from common import emit, median, model_dir  # noqa: E402

from lockstep.engine.types import SampleRequest, SamplingParams  # noqa: E402
from lockstep.runtime.actors import GeneratorActor, TrainerActor  # noqa: E402

ONE_TOKEN = [SampleRequest((5, 6), SamplingParams(max_tokens=1, temperature=0.0, stop=()))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="builtin,20M,100M")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    for size in args.sizes.split(","):
        path = model_dir(size)
        trainer = TrainerActor.options(num_cpus=0.5).remote(path, 0, 32.0, 1)
        gen = GeneratorActor.options(num_cpus=0.5).remote(path, 0, 32.0, 1)
        ray.get([trainer.start_fresh.remote(), gen.stats.remote()])
        publish, visible = [], []
        for i in range(args.repeats + 1):
            t = time.perf_counter()
            version_ref, lineage_ref, weights_ref = trainer.publish.remote()
            lineage = ray.get([version_ref, lineage_ref])[1]
            t_pub = time.perf_counter()
            ray.get(gen.set_weights.remote(i + 1, weights_ref, time.time(), lineage))
            ray.get(gen.sample.remote(ONE_TOKEN))  # applies the pending weights, as a rollout's call does
            lat = ray.get(gen.stats.remote())["swap_latency_s_last"]
            if i:  # the first round warms up
                publish.append(t_pub - t)
                visible.append(lat)
            gen_stats = ray.get(gen.stats.remote())
        ray.kill(trainer)
        ray.kill(gen)
        rows.append({"model": size, "publish_ms": median(publish) * 1e3, "publish_to_visible_ms": median(visible) * 1e3,
                     "swaps": gen_stats["swaps"]})
    emit("weight_swap", rows)


if __name__ == "__main__":
    main()
