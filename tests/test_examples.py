"""The example loop runs on the public API (a few steps; learning is checked by `lockstep run`)."""

import importlib.util
from pathlib import Path


def test_minimal_grpo_example_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCKSTEP_HOME", str(tmp_path))
    path = Path(__file__).parents[1] / "examples" / "minimal_grpo.py"
    spec = importlib.util.spec_from_file_location("minimal_grpo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    after_sft, final, steps = module.main(sft_steps=3, rl_steps=2)
    assert steps == 5  # every SFT and GRPO step reached the optimizer
    assert after_sft in {i / 100 for i in range(101)} and final in {i / 100 for i in range(101)}  # over 100 problems
