"""The CI gate: `lockstep check consistency --json` reports every token bitwise equal."""

import json
import os
import subprocess
import sys

import pytest


def _check(*args, home, **env_vars):
    env = dict(os.environ, LOCKSTEP_HOME=str(home), **env_vars)
    proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "check", "consistency", "--json", *args],
                          capture_output=True, text=True, timeout=600, env=env)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return proc.returncode, report


@pytest.mark.parametrize("which,path", [("builtin", "fused"), ("qwen2", "fused"), pytest.param("builtin", "eager", marks=pytest.mark.slow)])
def test_every_sampled_token_is_bitwise_equal(which, path, qwen2_dir, tmp_path):
    """On the fused kernels (the default: scripts/setup.sh builds them) and on the pure-PyTorch
    fallback; LoRA off and on; batches 1, 7 and 64; sampler and trainer at 1, 2 and 4 threads."""
    args = [] if which == "builtin" else ["--model", qwen2_dir]
    code, report = _check(*args, home=tmp_path, LOCKSTEP_KERNELS=path)
    assert code == 0
    assert report["path"] == path
    assert report["tokens_compared"] >= 6000
    assert report["tokens_bitwise_equal"] == report["tokens_compared"]
    assert report["max_abs_diff"] == 0.0 and report["mean_abs_diff"] == 0.0
    assert {(c["lora"], c["batch"], tuple(c["threads"])) for c in report["cases"]} == {
        (lora, b, t) for lora in (False, True) for b in (1, 7, 64) for t in ((1, 4), (2, 1), (4, 2))}
    hf = report["hf"]  # the plain transformers path is measured on the same prompts (once per batch)
    assert hf["tokens_compared"] * 3 == report["tokens_compared"]
    assert {"tokens_bitwise_equal", "max_abs_diff", "mean_abs_diff"} <= hf.keys()
    assert not report["moe"] and report["routing_compared"] == 0


@pytest.mark.parametrize("drafter,path", [pytest.param("suffix", "fused", marks=pytest.mark.slow), pytest.param("suffix", "eager", marks=pytest.mark.slow),
                                         pytest.param("model", "fused", marks=pytest.mark.slow)])
def test_speculative_decoding_keeps_every_token_bitwise_equal(drafter, path, tmp_path):
    """`--speculative suffix|model`: the sampler verifies drafted tokens in its forward; every
    sampled token's logprob still equals the trainer's, and drafts were really accepted."""
    code, report = _check("--speculative", drafter, "--draft-tokens", "3", home=tmp_path, LOCKSTEP_KERNELS=path)
    assert code == 0
    assert report["tokens_bitwise_equal"] == report["tokens_compared"] >= 6000
    spec = report["speculative"]
    assert spec["drafter"] == drafter and spec["draft_tokens"] == 3
    assert spec["drafted"] > spec["accepted"] > 0


def test_an_unknown_drafter_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "check", "consistency", "--speculative", "tree"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'tree'" in proc.stderr and "suffix" in proc.stderr


@pytest.mark.parametrize("path", ["fused", pytest.param("eager", marks=pytest.mark.slow)])
def test_a_mixture_of_experts_samples_and_routes_exactly_as_it_trains(path, moe_dir, tmp_path):
    """Qwen3-MoE: every sampled token's logprob, and every token's expert choice in every MoE
    layer, equal between the sampler's decode and the trainer's forward (no routing replay)."""
    code, report = _check("--model", moe_dir, home=tmp_path, LOCKSTEP_KERNELS=path)
    assert code == 0 and report["moe"] and report["path"] == path
    assert report["tokens_bitwise_equal"] == report["tokens_compared"] >= 3000
    # 2 MoE layers x 2 experts per token x every token fed (prompt and generated)
    assert report["routing_equal"] == report["routing_compared"] > 2 * 2 * report["tokens_compared"]
    assert {c["lora"] for c in report["cases"]} == {False}  # LoRA on experts: refused, not run


def test_unsupported_model_fails_cleanly(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    proc = subprocess.run([sys.executable, "-m", "lockstep.cli", "check", "consistency", "--model", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unsupported architecture" in proc.stderr


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from conftest import random_arch_dir

    return random_arch_dir(tmp_path_factory, "qwen3")


@pytest.mark.parametrize("which,path,drafter", [
    ("builtin", "fused", "off"), ("builtin", "eager", "off"), ("qwen3", "fused", "off"),
    pytest.param("builtin", "fused", "suffix", marks=pytest.mark.slow),  # in-process: test_multi_tenant.py
    pytest.param("qwen3", "eager", "off", marks=pytest.mark.slow)])
def test_four_tenants_packed_get_their_alone_bits(which, path, drafter, qwen3_dir, tmp_path):
    """The gate of issue 28: `--tenants 4` (ranks 4, 1, 8, 2 on different target sets, two with
    lm_head, and rows on the bare base) packed against alone: every sampled token and logprob, every trainer logprob,
    loss, metric and gradient element bitwise equal, on the fused kernels and the eager fallback,
    the built-in model and a tiny Qwen3 (q/k norms, head_dim 24: projections of other shapes)."""
    args = ["--tenants", "4", "--speculative", drafter] + ([] if which == "builtin" else ["--model", qwen3_dir])
    code, report = _check(*args, home=tmp_path, LOCKSTEP_KERNELS=path)
    assert code == 0 and report["ok"], report
    assert report["path"] == path and report["tenants"] == 4
    assert [a["rank"] for a in report["adapters"]] == [4, 1, 8, 2]
    assert len({tuple(a["targets"]) for a in report["adapters"]}) == 4
    assert [("lm_head" in a["targets"]) for a in report["adapters"]] == [True, False, True, False]
    sampler = report["sampler"]
    assert sampler["tokens_bitwise_equal"] == sampler["tokens_compared"] >= 100
    for kind, parts in report["trainer"].items():
        for what, c in parts.items():
            assert c["equal"] == c["compared"] > 0, (kind, what)
    assert report["trainer"]["forward_backward"]["grads"]["compared"] >= 10_000
    vs = report["sampler_vs_trainer"]
    assert vs["tokens_bitwise_equal"] == vs["tokens_compared"] >= 100
    assert report["prefix_groups"] >= 1  # a tenant's shared prompt took the trainer's prefix path
    if drafter != "off":
        assert report["speculative"]["accepted"] > 0
