"""`lockstep run` end to end on Ray: a few steps of SFT then RL, sync and async."""

import json

import pytest
import ray

from lockstep.config import load
from lockstep.runtime.run import run

TINY = ["stages.0.steps=6", "stages.0.batch_size=16", "stages.0.eval_every=3", "stages.0.target_accuracy=0.0",
        "rl.steps=4", "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_every=2", "rl.max_seconds=0",
        "rl.learning_rate=3e-4", "rl.temperature=2.0", "env.num_heldout=20", "runtime.checkpoint_every=5"]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    ray.shutdown()


@pytest.mark.parametrize("staleness", [0, 2])
def test_run_writes_a_complete_run_directory(tmp_path, builtin_dir, staleness):
    spec = load(None, [*TINY, f"model.path='{builtin_dir}'", f"rl.max_staleness={staleness}"])
    summary = run(spec, tmp_path / "run")
    d = tmp_path / "run"
    for name in ("config.json", "metrics.jsonl", "summary.json", "report.html"):
        assert (d / name).is_file(), name
    assert (d / "final_model" / "config.json").is_file() and (d / "final_model" / "model.safetensors").is_file()
    assert (d / "checkpoints" / "step-000005" / "MANIFEST.json").is_file()
    assert json.loads((d / "config.json").read_text())["stages"][1]["max_staleness"] == staleness
    for key in ("eval_accuracy_start", "eval_accuracy_after_sft", "eval_accuracy_final", "wall_seconds", "steps"):
        assert key in summary
    assert summary["steps"] == 10
    records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if "rollout/reward_mean" in r]
    assert len(rl) == 4
    assert all(0 <= r["rollout/staleness_max"] <= staleness for r in rl)  # the bound holds
    for key in ("filter/zero_variance", "filter/truncated", "filter/stale", "env/failures", "time/step_s"):
        assert key in rl[0]
    assert any("eval/accuracy" in r for r in records)
    assert "<img" in (d / "report.html").read_text()
