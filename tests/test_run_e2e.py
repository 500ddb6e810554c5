"""`lockstep run` end to end on Ray: a few steps of SFT then RL, sync and async."""

import json

import pytest
import ray

from lockstep.config import load
from lockstep.runtime.run import run

TINY = ["stages.0.steps=6", "stages.0.batch_size=16", "stages.0.eval_every=3", "stages.0.target_accuracy=0.0",
        "rl.steps=4", "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_every=2", "rl.max_seconds=0",
        "rl.learning_rate=3e-4", "env.num_heldout=20", "runtime.checkpoint_every=5"]


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
    for key in ("filter/zero_variance", "filter/truncated", "filter/stale", "env/failures", "time/step_s",
                "mismatch/abs", "mismatch/k3_kl", "mismatch/ess"):
        assert key in rl[0]
    assert any("eval/accuracy" in r for r in records)
    for r in rl:  # the staleness histogram covers every trained sample, within the bound
        hist = {int(k.split("/")[1]): v for k, v in r.items() if k.startswith("staleness/")}
        assert sum(hist.values()) == 4 * 4 and max(hist) <= staleness and min(hist) >= 0
        assert r["queue/in_flight_batches"] <= staleness + 1 and r["queue/buffered_groups"] >= 0
    if staleness == 0:  # on-policy: the trainer recomputes exactly the sampler's logprobs
        assert all(r["mismatch/abs"] == 0.0 and r["mismatch/ess"] == 1.0 for r in rl)
    assert "<img" in (d / "report.html").read_text() and "Per-stage throughput" in (d / "report.html").read_text()
    assert [r["stage"] for r in summary["stages"]] == ["sft", "rl"] and summary["stages"][1]["steps"] == 4


def test_a_hung_call_becomes_a_clear_error():
    from lockstep.runtime.controller import ComponentError, wait

    @ray.remote
    def hang():
        import time

        time.sleep(30)

    with pytest.raises(ComponentError, match="did not answer within 1s"):
        wait(hang.remote(), 1.0, "hang")


def test_env_exceptions_are_retried_then_counted(builtin_dir):
    from lockstep.envs.arithmetic import Problem
    from lockstep.runtime.actors import EnvWorker
    from lockstep.runtime.types import RolloutGroup, Sample

    worker = EnvWorker.options(num_cpus=0.1).remote(builtin_dir, 6, retries=2)
    good = RolloutGroup("g", (5,), Problem(1, 2, 3), (Sample((52, 52, 52, 55, 2), (), 0, "stop"),))
    broken = RolloutGroup("b", (5,), None, (Sample((1,), (), 0, "stop"), Sample((2,), (), 0, "stop")))
    scored, failures = ray.get(worker.score.remote([good, broken]), timeout=60)
    assert failures == 2  # both samples of the broken group failed every retry
    assert scored[0].samples[0].reward == 1.0  # "0003" + EOS is the right answer to 001+002
    assert [s.reward for s in scored[1].samples] == [0.0, 0.0]


def test_mismatch_panel_is_zero_on_policy():
    """Sync (staleness 0) samples are trained on the weights that produced them: exactly zero."""
    import numpy as np

    from lockstep.engine.types import Datum
    from lockstep.runtime.actors import _mismatch

    d = Datum((1, 2, 3), {"target_tokens": np.array([2, 3, 4]), "logprobs": np.array([0.0, -0.5, -1.0], np.float32)})
    same = _mismatch([d], [{"logprobs": np.array([-9.0, -0.5, -1.0], np.float32)}], [1])
    assert same["mismatch_abs:max"] == 0.0 and same["mismatch_k3_kl:mean"] == 0.0 and same["mismatch_ess:mean"] == 1.0
    off = _mismatch([d], [{"logprobs": np.array([0.0, -0.25, -1.0], np.float32)}], [1])
    assert off["mismatch_abs:max"] == 0.25 and off["mismatch_k3_kl:mean"] > 0 and off["mismatch_ess:mean"] < 1
