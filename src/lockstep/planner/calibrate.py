"""This machine's CPU as a planner device, measured: the engine's own matrix product at the model's
shapes (forward + backward at the trainer's rows, forward at the sampler's rows), memory bandwidth,
and the fixed cost of one product call.

Why the model's own shapes and not one big sgemm: the built-in model's products are 128-512 wide,
where a CPU reaches a fraction of its large-sgemm peak that depends on the shape and the row count
(BENCHMARKS.md section 3: 38% at the built-in size, 58% at 20M). Measuring the products the step
will run turns the planner's FLOP count into time without a fitted efficiency.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import replace

from lockstep.planner.types import GIB, Device, ModelShape, Overheads

GLOO_BW = 5.05e6 / 14.8e-3
"""Bytes/s of the data-parallel trainer's chained gradient sum over gloo on loopback: 1.26M fp32
gradients (5.05 MB) in 14.8 ms with two ranks (BENCHMARKS.md section 15, this project's
measurement on a 2-vCPU EPYC)."""


PUBLISH_BW = (416e6 - 5.05e6) / (95e-3 - 10.9e-3)
"""Bytes/s of a weight publish through Ray's object store, from its growth between the built-in
model (5.05 MB fp32, 10.9 ms) and 100M (416 MB, 95 ms): BENCHMARKS.md section 4, run 2 (2026-12-06;
run 1's 19.5 and 155 ms made the built-in model's sync 25.8 ms, against 7 ms for the publish
span of a run's step measured that day)."""
PUBLISH_LATENCY = 10.9e-3 - 5.05e6 / PUBLISH_BW + 4.8e-3
"""Seconds of a publish's fixed part plus publish-to-visible in the generator (4.8 ms), same source."""


def _time_call(fn, repeats: int, *, min_sample_s: float = 2e-3, best: bool = False) -> float:
    """Median (or with `best`, the least) seconds of one call over `repeats` samples, after a
    warm-up; calls shorter than `min_sample_s` run several times per sample, so that a sample is not
    the timer's noise. Calibration takes the least: on a shared machine contention only adds time,
    and a thread pool waiting on a descheduled thread adds a lot."""
    t = time.perf_counter()
    fn()  # warm-up: first-touch allocations, kernel plan caches
    inner = max(1, int(min_sample_s / max(time.perf_counter() - t, 1e-7)))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return min(times) if best else statistics.median(times)


DECODE_ROWS = (8, 24, 48)
"""Rows at which the sampler's overheads are measured (products pad rows to 8); runs plan 64-128."""


def _products(shape: ModelShape) -> list[tuple[int, int, int]]:
    """(in, out, count) of the model's products as the engine runs them: q|k|v and gate|up fused."""
    kv = shape.num_kv_heads * shape.head_dim
    mlp_out = (2 if shape.gated_mlp else 1) * shape.intermediate
    return [(shape.hidden, shape.hidden + 2 * kv, shape.num_layers), (shape.hidden, shape.hidden, shape.num_layers),
            (shape.hidden, mlp_out, shape.num_layers), (shape.intermediate, shape.hidden, shape.num_layers),
            (shape.hidden, shape.vocab, 1)]


def product_rate(shape: ModelShape, rows: int, *, backward: bool, repeats: int = 5) -> float:
    """FLOP/s of the model's products at `rows` rows through the engine's linear (fixed tile plan):
    2 x rows x in x out per product forward, twice that again with the backward."""
    import torch

    from lockstep.engine.invariant import linear

    gen = torch.Generator().manual_seed(0)
    total_s, total_flops = 0.0, 0.0
    for d_in, d_out, count in _products(shape):
        x = torch.randn(rows, d_in, generator=gen, requires_grad=backward)
        w = torch.randn(d_out, d_in, generator=gen, requires_grad=backward)

        def run():
            if backward:
                y = linear(x, w)
                y.backward(torch.ones_like(y))
            else:
                with torch.no_grad():
                    linear(x, w)
        total_s += count * _time_call(run, repeats, best=True)
        total_flops += count * 2 * rows * d_in * d_out * (3 if backward else 1)
    return total_flops / total_s


def memory_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a large copy (read + write), the rate of streaming element-wise work."""
    import torch

    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _time_call(lambda: dst.copy_(src), repeats, best=True)


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope), neither below zero (noise can push one there)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


def _solve3(rows: list[list[float]], rhs: list[float]) -> list[float]:
    """x with rows @ x = rhs (Cramer's rule; the calibration's three measurements)."""
    def det(m):
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))
    d = det(rows)
    out = []
    for j in range(3):
        m = [list(r) for r in rows]
        for i in range(3):
            m[i][j] = rhs[i]
        out.append(det(m) / d)
    return out


class BuiltinEngine:
    """The engine on the built-in model: a sampler and a trainer to time (calibration, tests, bench)."""

    def __init__(self):
        from lockstep.engine.loading import load_model
        from lockstep.engine.model import InvariantLM
        from lockstep.engine.sampler import Sampler
        from lockstep.engine.tiny import ensure_tiny_model
        from lockstep.engine.trainer import Trainer

        model_dir = str(ensure_tiny_model())
        hf, tok = load_model(model_dir)
        self.sampler = Sampler(InvariantLM(hf), tok)
        self.trainer = Trainer.from_pretrained(model_dir)

    def sample_s(self, rows: int, prompt: int, new: int, repeats: int, *, best: bool = False) -> float:
        """Median (`best`: least) seconds of one `sample` call: `rows` prompts of `prompt` tokens,
        `new` tokens each."""
        from lockstep.engine.types import SampleRequest, SamplingParams

        reqs = [SampleRequest(tuple(4 + (r + i) % 200 for i in range(prompt)),
                              SamplingParams(max_tokens=new, seed=r, stop=())) for r in range(rows)]
        return _time_call(lambda: self.sampler.sample(reqs), repeats, best=best)

    def train_step_s(self, rows: int, length: int, repeats: int, *, best: bool = False) -> float:
        """Median (`best`: least) seconds of forward_backward (cross-entropy, one micro-batch) +
        optim_step."""
        from lockstep.engine.types import AdamParams, Datum

        data = [Datum.from_tokens([4 + (r + i) % 200 for i in range(length + 1)]) for r in range(rows)]

        def step():
            self.trainer.forward_backward(data, "cross_entropy")
            self.trainer.optim_step(AdamParams(learning_rate=1e-6))
        return _time_call(step, repeats, best=best)


def engine_overheads(shape: ModelShape, device: Device, repeats: int = 5) -> tuple[float, Overheads]:
    """(attention FLOP/s, overheads): the engine's time beyond its products and memory traffic,
    measured on the built-in model at small sizes and solved for. The trainer at 1 x 16, 4 x 32 and
    1 x 128 tokens gives a fixed part (autograd dispatch, the optimizer loop), a part per token (the
    loss, log-softmax) and the attention kernel's rate (it is not a product); the sampler at 8, 24 and
    48 rows (products pad rows to 8) gives a fixed part per decode step (the Python loop) and a part
    per row (log-softmax, the draw, stop checks), fitted as a line. The parts scale with the number of layers, so
    they are scaled to `shape`. A run's sizes (64-128 rows, thousands of tokens) extrapolate."""
    from lockstep.planner.cost import attention_flops_per_token, decode_step_s, trainer_step
    from lockstep.planner.shapes import builtin_shape
    from lockstep.planner.types import TrainLayout, Workload

    tiny, engine = builtin_shape(), BuiltinEngine()

    def at(rows: int, *, backward: bool) -> Device:
        # The built-in model's own products at this size: what remains is the engine's overhead,
        # not the products' lower efficiency at few rows.
        rate = product_rate(tiny, rows, backward=backward, repeats=repeats)
        return replace(device, flops=rate, decode_flops=rate, attention_flops=float("inf"))

    sizes = ((1, 16), (4, 32), (1, 128))
    extra = [engine.train_step_s(rows, length, repeats, best=True)
             - trainer_step(tiny, Workload("sft", rows, length, 0), at(rows * length, backward=True),
                            TrainLayout(micro_batch=rows)).step_s
             for rows, length in sizes]
    # attention's FLOPs with the backward: 3x the forward's 4 x ctx x hidden per layer, ctx = length / 2
    terms = [[1.0, rows * length, 3 * rows * length * attention_flops_per_token(tiny, length / 2)]
             for rows, length in sizes]
    batch, token, per_flop = _solve3(terms, extra)
    attention_rate = 1 / per_flop if per_flop > 0 else device.flops
    new, prompt = 64, 8

    def decode_extra(rows: int) -> float:
        per_step = engine.sample_s(rows, prompt, new, repeats, best=True) / new
        rated = replace(at(rows, backward=False), attention_flops=attention_rate)
        return per_step - decode_step_s(tiny, rated, 1, rows, prompt + new / 2)

    step, row = _fit_line([(rows, decode_extra(rows)) for rows in DECODE_ROWS])
    scale = shape.num_layers / tiny.num_layers
    return attention_rate, Overheads(decode_step=step * scale, decode_row=row * scale,
                                     train_batch=max(0.0, batch) * scale, train_token=max(0.0, token) * scale)


def ram_bytes() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 8.0 * GIB


def cpu_model_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def env_episode_s(spec, model_path: str, groups: int = 2) -> float:
    """Seconds of env work per episode, as the env worker does it: build a group's envs, their first
    observation, one step with a completion of the planned length, its reward. Measured on the
    config's own env suite (its first `groups` training groups, after a warm-up on the same ones)."""
    import asyncio

    from transformers import AutoTokenizer

    from lockstep.envs.registry import make_suite
    from lockstep.planner.shapes import completion_tokens

    stage = next(st for st in spec.stages if st.kind == "rl")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    builders = list(make_suite(spec.env, tokenizer, seed=spec.seed).train(stage.prompts_per_step).get_batch(0))[:groups]
    action = (tokenizer.encode("0123456789") * completion_tokens(spec))[: completion_tokens(spec)]

    async def episode(env) -> None:
        try:
            await env.initial_observation()
            await env.step(list(action))
        except Exception:  # noqa: BLE001 - a failing env still costs its time, as in a run
            pass

    async def rollout() -> None:
        envs = [env for b in builders for env in b.make_envs(stage.group_size, tokenizer)]
        await asyncio.gather(*(episode(env) for env in envs))

    asyncio.run(rollout())  # warm-up: imports, caches
    t = time.perf_counter()
    asyncio.run(rollout())
    return (time.perf_counter() - t) / (len(builders) * stage.group_size)


@functools.lru_cache(maxsize=16)
def calibrate_cpu(shape: ModelShape, *, threads: int, train_rows: int, decode_rows: int,
                  repeats: int = 5) -> Device:
    """`threads` cores of this CPU as one device, its product rates measured at the trainer's and
    the sampler's row counts. Runs torch at `threads` threads and restores the setting."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        train = product_rate(shape, train_rows, backward=True, repeats=repeats)
        decode = product_rate(shape, decode_rows, backward=False, repeats=repeats)
        bandwidth = memory_bandwidth(repeats=repeats)
        bare = Device(f"{cpu_model_name()} x{threads}", "cpu", flops=train, memory=ram_bytes(), memory_bw=bandwidth,
                      link_bw=GLOO_BW, network_bw=GLOO_BW, per_node=1, bytes_per_param=4,
                      sync_bw=PUBLISH_BW, sync_latency=PUBLISH_LATENCY,
                      decode_flops=decode, source=f"measured on this machine at {threads} thread(s)")
        attention, overheads = engine_overheads(shape, bare, repeats)
    finally:
        torch.set_num_threads(before)
    return replace(bare, attention_flops=attention, overheads=overheads)
