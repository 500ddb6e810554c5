"""The parallel-strategy planner (issue 19 point 4): the cost model by hand, the event simulation,
published runs within 20%, this machine within 25%, refusals that name the resource, the CLI."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from lockstep.planner import GPUS, Cluster, ModelShape, PlanRefused, Workload, gpu, parse_gpus
from lockstep.planner.cost import (MEMORY_EFFICIENCY, all_reduce_s, decode_step_s, forward_flops_per_token,
                                   trainer_memory, trainer_step)
from lockstep.planner.published import check, load_rows
from lockstep.planner.report import SCHEMA_KEYS
from lockstep.planner.search import best_generator, plan_gpus
from lockstep.planner.simulate import simulate
from lockstep.planner.types import TrainLayout

DATA = Path(__file__).parent / "data" / "planner_published.json"
SMALL = ModelShape("small", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, intermediate=128, vocab=100)
LLAMA_405B = ModelShape("llama-405b", num_layers=126, hidden=16384, num_heads=128, num_kv_heads=8,
                        intermediate=53248, vocab=128256, tied_embeddings=False)


# --- the cost model, by hand ----------------------------------------------------------------------

def test_parameter_and_flop_counts_by_hand():
    # per layer: q, o 64x64 each; k, v 64x32 each (2 kv heads of 16); gate, up, down 64x128 each
    assert SMALL.layer_matmul_params == 2 * 4096 + 2 * 2048 + 3 * 8192 == 36864
    assert SMALL.matmul_params == 2 * 36864 + 100 * 64  # the tied head still runs its product
    assert SMALL.params == 2 * (36864 + 2 * 64) + 100 * 64 + 64  # norms, embedding, final norm
    # forward of one token attending to 10 keys: 2 per weight, 4 x ctx x hidden per layer, the head
    assert forward_flops_per_token(SMALL, 10) == 2 * (2 * 36864 + 4 * 10 * 64) + 2 * 100 * 64
    assert SMALL.kv_elements_per_token == 2 * 2 * 2 * 16


def test_ring_all_reduce_sends_twice_the_data_less_a_share():
    assert all_reduce_s(1e9, 4, 1e9) == pytest.approx(2 * 3 / 4)
    assert all_reduce_s(1e9, 1, 1e9) == 0.0


def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    device = GPUS["H100-SXM"]
    work = Workload("sft", 16, 512, 0)
    cost = trainer_step(SMALL, work, device, TrainLayout(pp=2, micro_batch=2))  # m = 8 micro-batches, p = 2
    busy = cost.step_s - cost.dp_comm_s - cost.optimizer_s
    assert cost.bubble_s / busy == pytest.approx(1 / (8 + 1))
    interleaved = trainer_step(SMALL, work, device, TrainLayout(pp=2, micro_batch=2, interleave=2))
    assert interleaved.bubble_s < cost.bubble_s


def test_trainer_memory_by_hand():
    device = GPUS["A100-80G"]
    layout = TrainLayout(dp=2, tp=2, pp=1, micro_batch=1)
    mem = trainer_memory(SMALL, Workload("sft", 8, 256, 0), device, layout)
    stage = 2 * (36864 + 2 * 64) + 100 * 64  # both layers, their norms, the embedding
    assert mem.weights == stage / 2 * 2  # bf16, halved by TP
    assert mem.grads == stage / 2 * 4 / 2  # fp32 main grads, sharded over DP
    assert mem.optimizer == stage / 2 * 12 / 2  # fp32 master + m + v, sharded over DP
    full = trainer_memory(SMALL, Workload("sft", 8, 256, 0), device, replace(layout, recompute="full"))
    assert full.activations < mem.activations


def test_decode_of_a_large_model_at_batch_one_is_bound_by_reading_the_weights():
    device = GPUS["H100-SXM"]
    step = decode_step_s(LLAMA_405B, device, 8, 1, 100)
    weights = LLAMA_405B.params * 2 / 8 / (device.memory_bw * MEMORY_EFFICIENCY)
    assert step == pytest.approx(weights, rel=0.01)


# --- the event simulation -------------------------------------------------------------------------

def test_synchronous_step_is_generate_plus_train_plus_sync():
    sim = simulate(generate_s=1.0, train_s=0.5, sync_s=0.1, max_staleness=0)
    assert sim.step_s == pytest.approx(1.6)
    assert sim.mean_staleness == 0
    assert sim.generator_busy == pytest.approx(1.0 / 1.6)


@pytest.mark.parametrize("generate_s, train_s", [(1.0, 0.5), (0.5, 1.0)])
def test_asynchronous_step_is_the_slower_stage(generate_s, train_s):
    sim = simulate(generate_s=generate_s, train_s=train_s, sync_s=0.1, max_staleness=1)
    assert sim.step_s == pytest.approx(max(generate_s, train_s))
    assert 0 < sim.mean_staleness <= 1
    assert max(sim.generator_busy, sim.trainer_busy) == pytest.approx(1.0)


def test_staleness_bound_limits_batches_in_flight():
    # A slow sync: with bound 1 the generator waits for the weights of two steps back.
    slow = simulate(generate_s=0.2, train_s=1.0, sync_s=2.0, max_staleness=1)
    assert slow.step_s == pytest.approx(1.6)  # generate after train end + sync, then train: (2.0 + 1.0 + 0.2) / 2
    assert simulate(generate_s=0.2, train_s=1.0, sync_s=2.0, max_staleness=3).step_s == pytest.approx(1.0)


# --- the RL loop as the runtime runs it ------------------------------------------------------------

def _runtime_rounds(prompts: int, q: float, steps: int, sync: bool, rng) -> float:
    """The controller's dynamic sampling (RLLoop.batch_ready), drawn: batches of `prompts` groups,
    each with signal with probability q; a step takes `prompts` of them, after at most
    MAX_REFILL_BATCHES batches; leftovers go stale in a sync loop and are kept in an async one."""
    from lockstep.runtime.types import MAX_REFILL_BATCHES

    batches, buffer = 0, 0
    for _ in range(steps):
        refills = 0
        while True:
            buffer += sum(rng.random() < q for _ in range(prompts))
            batches, refills = batches + 1, refills + 1
            if buffer >= prompts or refills >= MAX_REFILL_BATCHES:
                break
        buffer = 0 if sync else max(0, buffer - prompts)
    return batches / steps


@pytest.mark.parametrize("zero_variance", [0.0, 0.17, 0.5, 0.9])
@pytest.mark.parametrize("staleness", [0, 2])
def test_rollout_rounds_per_step_match_the_runtimes_refill_rule(zero_variance, staleness):
    import random

    from lockstep.planner.loop import rounds_per_step

    drawn = _runtime_rounds(16, 1 - zero_variance, 20000, staleness == 0, random.Random(0))
    assert rounds_per_step(16, zero_variance, staleness) == pytest.approx(drawn, rel=0.03)
    if staleness:  # leftovers kept: a step costs 1 / q rounds, capped by the refill limit
        assert rounds_per_step(16, zero_variance, staleness) == min(4.0, 1 / (1 - zero_variance))


def test_a_workload_share_without_signal_is_checked():
    with pytest.raises(ValueError, match="zero_variance must be in"):
        Workload("rl", 8, 4, 4, zero_variance=1.0)


@pytest.mark.slow  # a 100-step `lockstep run` (~30 s)
def test_the_planner_models_a_synchronous_rl_step_of_this_machine(tmp_path, warm_dir):
    """`lockstep run` of a synchronous RL stage from a warmed-up model (16 prompts x 8, the
    allocator off so that the configured 1 + 1 threads run), against the planner's step for the
    same config, given the share of groups without signal the run measured: its rollout rounds
    per step are the run's, and its step is those rounds of sampling and env work, then the train
    step, then the weight sync, each calibrated on this machine. How close the predicted time
    comes to the measured one is a benchmark, not a test (timings are never asserted here):
    bench/planner.py and BENCHMARKS.md section 16, where it ranges from 1.08x of measured on one
    2-vCPU EPYC to 1.2-1.5x on another."""
    import ray

    from lockstep.config import load
    from lockstep.planner import cpu_cluster, plan_run
    from lockstep.planner.calibrate import env_episode_s
    from lockstep.planner.loop import rounds_per_step
    from lockstep.planner.shapes import spec_workload
    from lockstep.runtime.run import run

    spec = load(None, ["stages=[{kind = 'rl', steps = 100, prompts_per_step = 16, group_size = 8, eval_every = 100000, "
                       "max_seconds = 0, target_accuracy = 0.0, max_staleness = 0}]",
                       f"model.path='{warm_dir}'", "env.num_heldout=8", "env.pass_k=0", "runtime.cpus=2",
                       "runtime.allocator=false", "runtime.checkpoint_every=0"])
    d = tmp_path / "run"
    summary = run(spec, d)
    ray.shutdown()
    batches = sum('"generate"' in x for x in (d / "trace.jsonl").read_text().splitlines())
    zero_variance = summary["counters"]["filter/zero_variance"] / (batches * 16)
    rounds = rounds_per_step(16, zero_variance, 0)
    assert rounds == pytest.approx(batches / 100, abs=0.1), (rounds, batches)  # the controller's refill rule
    work = replace(spec_workload(spec), zero_variance=zero_variance, env_episode_s=env_episode_s(spec, warm_dir))
    plan = plan_run(spec, cpu_cluster(2), workload=work, pin_staleness=True)
    assert plan.max_staleness == 0 and plan.generator_replicas == 1
    round_s = plan.generate.batch_s + work.env_episode_s * work.sequences
    assert work.env_episode_s > 0 and min(plan.train.step_s, plan.generate.batch_s, plan.simulation.sync_s) > 0
    # Synchronous: nothing overlaps, so the step is the sum of its parts.
    assert plan.step_s == pytest.approx(rounds * round_s + plan.train.step_s + plan.simulation.sync_s, rel=1e-6)


# --- published runs: within 20% --------------------------------------------------------------------

def test_every_published_row_is_cited():
    conventions, rows = load_rows(DATA)
    assert len(rows) >= 5
    for row in rows:
        src = row["source"]
        assert all(src.get(k) for k in ("title", "authors", "year", "where", "url")), row["id"]
        assert src["url"].startswith("https://")
        assert row.get("flops_convention", "megatron_recompute") in conventions
        assert row["dp"] * row["tp"] * row["pp"] == row["gpus"], row["id"]


@pytest.mark.parametrize("row", load_rows(DATA)[1], ids=lambda r: r["id"])
def test_published_step_time_within_20_percent(row):
    result = check(row)
    assert abs(result.error) <= 0.20, (row["id"], result.published_s, result.predicted_s, result.layout)
    assert result.cost.memory.total <= gpu(row["device"]).memory  # the published layout fits


def test_mt_nlg_flop_count_matches_its_reported_throughput():
    """The MT-NLG rows' TFLOP/s and step times agree under Megatron's count with recomputation."""
    _, rows = load_rows(DATA)
    for row in (r for r in rows if r["id"].startswith("mt-nlg")):
        m, b, s = row["model"], row["global_batch"], row["seq_len"]
        l, h, v = m["num_layers"], m["hidden"], m["vocab"]
        flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
        implied = flops / (row["gpus"] * row["published"]["tflops_per_gpu"] * 1e12)
        assert implied == pytest.approx(row["published"]["step_s"], rel=0.02)


# --- refusals name the resource ----------------------------------------------------------------------

def test_a_model_that_cannot_fit_is_refused_with_its_memory():
    with pytest.raises(PlanRefused) as e:
        plan_gpus(LLAMA_405B, Workload("sft", 64, 4096, 0), GPUS["A100-40G"], 8)
    msg = str(e.value)
    assert e.value.resource == "trainer memory"
    assert "GiB per device needed" in msg and "weights" in msg and "optimizer" in msg
    assert "A100-40G has 40 GiB" in msg


def test_a_generator_that_cannot_hold_its_weights_is_refused():
    with pytest.raises(PlanRefused) as e:
        best_generator(LLAMA_405B, Workload("rl", 16, 128, 128, group_size=8), GPUS["H100-SXM"], 1)
    assert e.value.resource == "generator memory" and "H100-SXM has 80 GiB" in str(e.value)


def test_more_replicas_than_devices_is_refused():
    with pytest.raises(PlanRefused, match=r"rollout.replicas=9: the cluster has 8 GPUs"):
        plan_gpus(SMALL, Workload("rl", 128, 8, 6, group_size=8, max_staleness=1), GPUS["H100-SXM"], 8, replicas=9)


def test_nonsense_input_is_refused():
    with pytest.raises(PlanRefused, match="at least 1 device"):
        Cluster(GPUS["H100-SXM"], 0)
    with pytest.raises(PlanRefused, match="at least 1 device"):
        parse_gpus("H100-SXM:0")
    with pytest.raises(PlanRefused) as e:
        gpu("B200")
    assert all(kind in str(e.value) for kind in GPUS)
    with pytest.raises(PlanRefused, match="KIND:COUNT"):
        parse_gpus("H100-SXM")
    with pytest.raises(ValueError, match="num_heads"):
        ModelShape("bad", num_layers=2, hidden=100, num_heads=3, num_kv_heads=1, intermediate=10, vocab=10)
    with pytest.raises(ValueError, match="sequences"):
        Workload("rl", 0, 8, 6)


def test_gpu_plan_uses_every_device_and_fits():
    work = Workload("rl", 512, 512, 1024, group_size=8, max_staleness=2)
    shape = ModelShape("8b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, intermediate=14336,
                       vocab=128256, tied_embeddings=False)
    s = plan_gpus(shape, work, GPUS["H100-SXM"], 16, replicas=None)
    assert s.generator_devices + s.trainer_devices == 16
    assert s.trainer.devices == s.trainer_devices and s.generator_replicas * s.generator_tp == s.generator_devices
    assert s.train.memory.total <= GPUS["H100-SXM"].memory and s.generate.memory.total <= GPUS["H100-SXM"].memory
    assert 0 <= s.max_staleness <= 2 and s.step_s >= max(s.train.step_s, s.generate.batch_s) * 0.999


# --- this machine: calibrated -------------------------------------------------------------------------

@pytest.mark.slow  # calibrates this CPU (~a minute)
def test_this_cpu_calibrates_to_a_usable_device():
    """Calibrating this CPU gives a device the cost model can use: positive, finite predictions that
    grow with the work. How close they come to measured runs is timing, so it is a benchmark, not
    a test: bench/planner.py's `ratio_best` rows (BENCHMARKS.md section 16), one thread, the best of
    5 on both sides."""
    import torch

    from lockstep.planner.calibrate import calibrate_cpu
    from lockstep.planner.cost import generate_batch
    from lockstep.planner.shapes import builtin_shape

    shape, before = builtin_shape(), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        calibrate_cpu.cache_clear()
        device = calibrate_cpu(shape, threads=1, train_rows=32 * 64, decode_rows=64, repeats=1)
    finally:
        torch.set_num_threads(before)
    train = [trainer_step(shape, Workload("sft", b, 64, 0), device, TrainLayout(micro_batch=b)).step_s for b in (32, 64)]
    sample = [generate_batch(shape, Workload("rl", rows, 8, 32), device, 1, rows).batch_s for rows in (64, 128)]
    for what, (small, large) in (("train", train), ("sample", sample)):
        assert 0 < small < large < math.inf, (what, small, large)


# --- the CLI ------------------------------------------------------------------------------------------

def _run(capsys, argv):
    from lockstep.cli import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_json_for_a_gpu_cluster(capsys):
    code, out, _ = _run(capsys, ["plan", "--gpus", "H100-SXM:8", "--json", "rollout.replicas=2"])
    assert code == 0
    plan = json.loads(out)
    assert set(SCHEMA_KEYS) | {"generate", "generator_memory_gib", "simulation", "workload"} <= set(plan)
    assert plan["device"] == "H100-SXM" and plan["generator_replicas"] == 2
    assert plan["generator_devices"] + plan["trainer_devices"] == 8
    assert set(plan["trainer"]) >= {"dp", "tp", "pp", "micro_batch", "interleave", "recompute"}
    assert plan["step_s"] > 0 and 0 <= plan["simulation"]["generator_busy"] <= 1
    assert plan["workload"] == {"kind": "rl", "sequences": 128, "prompt_tokens": 8, "completion_tokens": 6,
                                "group_size": 8, "max_staleness_allowed": 2}


def test_plan_refusals_on_the_command_line(capsys, tmp_path):
    code, _, err = _run(capsys, ["plan", "--gpus", "H100-SXM:8", "rollout.replicas=9"])
    assert code == 2 and "rollout.replicas=9: the cluster has 8 GPUs" in err
    code, _, err = _run(capsys, ["plan", "--gpus", "B200:8"])
    assert code == 2 and "known kinds: A100-40G, A100-80G, H100-SXM, H200" in err
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 126, "hidden_size": 16384, "num_attention_heads": 128,
                                  "num_key_value_heads": 8, "intermediate_size": 53248, "vocab_size": 128256}))
    code, _, err = _run(capsys, ["plan", "--gpus", "A100-40G:8", "--model-config", str(config)])
    assert code == 2 and "trainer memory:" in err and "A100-40G has 40 GiB" in err
    code, _, err = _run(capsys, ["plan", "--gpus", "H100-SXM:8", "--zero-variance", "1"])
    assert code == 2 and "--zero-variance 1.0: expected a share in [0, 1)" in err


def test_plan_table_on_this_cpu(capsys):
    code, out, _ = _run(capsys, ["plan", "--cpus", "2"])
    assert code == 0 and "predicted step" in out and "generator" in out and "env work" in out
    code, out, _ = _run(capsys, ["plan", "--cpus", "2", "--zero-variance", "0.5", "--json"])
    notes = json.loads(out)["notes"]
    assert code == 0 and any("rollout rounds a step (50% of groups without signal)" in n for n in notes), notes


def test_dry_run_adds_the_strategy_and_refuses_what_cannot_fit(capsys):
    code, out, _ = _run(capsys, ["run", "--dry-run", "runtime.cpus=2"])
    assert code == 0
    dry = json.loads(out)
    assert {"config", "plan", "strategy"} <= set(dry)
    assert set(SCHEMA_KEYS) <= set(dry["strategy"]) and dry["strategy"]["devices"] == 2
    code, _, err = _run(capsys, ["run", "--dry-run", "runtime.cpus=2", "rollout.replicas=3"])
    assert code == 2 and "rollout.replicas=3" in err and "2 CPU core(s)" in err
    code, out, _ = _run(capsys, ["run", "--dry-run", "env.name=math", "env.path=rows.jsonl"])
    assert code == 0 and "--prompt-tokens" in json.loads(out)["strategy"]["skipped"]
