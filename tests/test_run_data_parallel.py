"""`lockstep run train.replicas=2`: two trainer processes on Ray (gloo), bit for bit the run of one
trainer accumulating the same micro-batches, through SFT and synchronous RL."""

import json

import pytest
import ray
from safetensors.numpy import load_file

from lockstep.config import load
from lockstep.runtime.run import run

SMALL = ["stages.0.steps=4", "stages.0.batch_size=16", "stages.0.eval_every=100", "stages.0.target_accuracy=0.0",
         "rl.steps=3", "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_every=100", "rl.max_seconds=0",
         "rl.max_staleness=0", "rl.target_accuracy=0.0", "env.num_heldout=8", "env.pass_k=0",
         "runtime.checkpoint_every=0", "train.micro_batches=3"]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    ray.shutdown()


def final_weights(d):
    return load_file(str(d / "checkpoints" / "final" / "model.safetensors"))


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_two_trainer_replicas_equal_one_bit_for_bit(tmp_path, builtin_dir):
    runs = {}
    for replicas in (1, 2):
        d = tmp_path / f"r{replicas}"
        run(load(None, [*SMALL, f"model.path='{builtin_dir}'", f"train.replicas={replicas}"]), d)
        runs[replicas] = d
        ray.shutdown()  # each run on its own Ray, as from the command line
    one, two = (final_weights(runs[r]) for r in (1, 2))
    assert one.keys() == two.keys() and all((one[k] == two[k]).all() for k in one)
    # Preempted after 2 RL steps on 2 replicas, resumed on 1 (`lockstep run --resume DIR
    # train.replicas=1`): the same micro-batches, so the run ends where the others did.
    from lockstep.config import rescale
    from lockstep.runtime.run import PREEMPT, Preempted

    d, spec = tmp_path / "rescaled", load(None, [*SMALL, f"model.path='{builtin_dir}'", "train.replicas=2"])
    with pytest.raises(Preempted):
        run(spec, d, lambda step, *a, **k: step == 4 + 2 and PREEMPT.set())
    PREEMPT.clear()
    ray.shutdown()
    resumed = rescale(load(None, [*SMALL, f"model.path='{builtin_dir}'", "train.replicas=2"]), ["train.replicas=1"])
    assert (resumed.train.replicas, resumed.train.micro) == (1, 3)
    run(resumed, d, resume=True)
    ray.shutdown()
    got = final_weights(d)
    assert all((got[k] == two[k]).all() for k in two)
    records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert [x["placement/trainer_replicas"] for x in records if "placement/trainer_replicas" in x][-1] == 1
    plan = json.loads((runs[2] / "config.json").read_text())
    assert plan["train"]["replicas"] == 2
    for r, d in runs.items():
        records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        assert sum("rollout/reward_mean" in x for x in records) == 3
        assert {x["placement/trainer_replicas"] for x in records if "placement/trainer_replicas" in x} == {r}


def test_a_resume_changes_only_where_the_run_goes_on():
    from lockstep.config import ConfigError, rescale

    spec = load(None, ["train.replicas=2"])  # micro_batches 0: one per replica, i.e. 2
    assert rescale(spec, ["train.replicas=1", "runtime.placement='spread'", "rollout.replicas=2"]).train.micro == 2
    with pytest.raises(ConfigError, match=r"train.replicas = 4 would need at least 4 micro-batches a step, but this "
                                          r"run accumulates 2 .*resume with train.replicas <= 2"):
        rescale(spec, ["train.replicas=4"])
    assert rescale(load(None, ["train.micro_batches=4"]), ["train.replicas=4"]).train.replicas == 4
    with pytest.raises(ConfigError, match="--resume: rl.learning_rate cannot change when a run resumes"):
        rescale(spec, ["rl.learning_rate=1e-3"])


def test_train_settings_are_checked_and_capped_for_jobs():
    from lockstep.config import ConfigError
    from lockstep.service.policy import Limits, check_spec
    from lockstep.service.types import ServiceError

    with pytest.raises(ConfigError, match=r"train.micro_batches: expected 0 or at least train.replicas \(2\)"):
        load(None, ["train.replicas=2", "train.micro_batches=1"])
    with pytest.raises(ConfigError, match="train.replicas: expected an integer in"):
        load(None, ["train.replicas=0"])
    with pytest.raises(ServiceError, match="train.replicas = 8 is over this server's cap max_train_replicas = 4"):
        check_spec({"train": {"replicas": 8}}, Limits())
