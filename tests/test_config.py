"""Run config: TOML + dotted overrides onto typed specs, unknown keys rejected with a suggestion."""

import pytest

from lockstep.config import ConfigError, load, to_dict
from lockstep.config.load import from_dict


def test_empty_config_is_the_embedded_default():
    spec = load()
    assert [s.kind for s in spec.stages] == ["sft", "rl"]
    assert spec.model.path == "builtin" and spec.env.name == "arithmetic"


def test_toml_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("""
seed = 7
[model]
lora_rank = 8
[[stages]]
kind = "sft"
steps = 10
[[stages]]
kind = "rl"
steps = 20
max_staleness = 0
""")
    spec = load(path, ["rl.max_staleness=2", "stages.0.learning_rate=0.01", "env.digits=2", "runtime.env_workers=2"])
    assert spec.seed == 7 and spec.model.lora_rank == 8
    assert spec.stages[1].max_staleness == 2 and spec.stages[1].steps == 20
    assert spec.stages[0].learning_rate == 0.01 and spec.env.digits == 2 and spec.runtime.env_workers == 2
    assert from_dict(to_dict(spec)) == spec  # the resolved config round-trips


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["rl.max_stalness=2"], r"stages\[1\]\.max_stalness: unknown key; did you mean 'max_staleness'"),
        (["modle.path=x"], "did you mean 'model'"),
        (["rl.learning_rate='fast'"], r"learning_rate: expected float"),
        (["rl.max_staleness=-1"], "max_staleness: expected an integer >= 0"),
        (["env.name=chess"], "env.name: expected one of"),
        (["rl.group_size=1"], "group_size: expected an integer >= 2"),
        (["stages.5.steps=1"], "no stage '5'"),
        (["novalue"], "expected key.path=value"),
        (["env.name=math"], "env.path: expected a .jsonl or .parquet file"),
        (["env.name=reasoning_gym"], "env.task: expected a reasoning_gym task name"),
        (["env.args=3"], "env.args: expected a table"),
        (["env.max_turns=0"], "env.max_turns: expected an integer >= 1"),
        (["rl.truncation=drop"], "truncation: expected 'keep', 'mask' or 'penalize'"),
        (["rl.stale_policy=ignore"], "stale_policy: expected 'regenerate' or 'drop'"),
        (["rl.dataset='x.jsonl'"], r"stages\[rl\]\.dataset: expected empty for an rl stage"),
        (["runtime.keep_checkpoints=0"], "keep_checkpoints: expected an integer >= 1"),
    ],
)
def test_invalid_config_names_the_key_path(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load(None, overrides)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\npath=1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load(bad)


def test_user_suites_and_their_args():
    spec = load(None, ["env.name='mypkg.envs:make_suite'", "env.args={level = 3}", "rl.loss_config={tis_cap = 2.0}"])
    assert spec.env.name == "mypkg.envs:make_suite" and spec.env.args == {"level": 3}
    assert spec.stages[1].loss_config == {"tis_cap": 2.0}


def test_a_user_written_stage_gets_its_kinds_tuned_defaults(tmp_path):
    """The README's [[stages]] blocks name no learning rate or batch size: they get the embedded
    default's tuned values per kind (RL at the generic 1e-3 collapsed a warmed-up model to 0%)."""
    path = tmp_path / "run.toml"
    path.write_text('[[stages]]\nkind = "sft"\nsteps = 600\n[[stages]]\nkind = "rl"\nmax_staleness = 1\n')
    sft, rl = load(path).stages
    embedded_sft, embedded_rl = load().stages
    assert (sft.learning_rate, sft.batch_size, sft.eval_every) == (3e-3, 128, 5)
    assert (rl.learning_rate, rl.eval_every) == (2e-4, 25)
    for ours, embedded in ((sft, embedded_sft), (rl, embedded_rl)):
        assert (ours.learning_rate, ours.batch_size, ours.eval_every) == (
            embedded.learning_rate, embedded.batch_size, embedded.eval_every)


def test_an_explicit_stage_value_wins_over_the_kinds_default(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[[stages]]\nkind = "sft"\nlearning_rate = 1e-3\nbatch_size = 64\neval_every = 50\n'
                    '[[stages]]\nkind = "rl"\nlearning_rate = 1e-3\n')
    sft, rl = load(path, ["rl.eval_every=7"]).stages
    assert (sft.learning_rate, sft.batch_size, sft.eval_every) == (1e-3, 64, 50)
    assert (rl.learning_rate, rl.eval_every) == (1e-3, 7)
    spec = load(path)
    assert from_dict(to_dict(spec)) == spec and to_dict(spec)["stages"][1]["learning_rate"] == 1e-3
    assert from_dict({"stages": [{"kind": "rl", "learning_rate": None}]}).stages[0].learning_rate == 2e-4  # JSON null


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["rl.loss=stable_reinforce"], r"stages\[1\]\.loss: loss 'stable_reinforce' is not supported.*importance_sampling"),
        (["rl.loss=nope"], r"stages\[1\]\.loss: unknown loss 'nope'; supported: cross_entropy, importance_sampling"),
        (["rl.loss=ppo", "rl.loss_config={beta = 1.0}"], r"loss 'ppo' does not take config keys \['beta'\]"),
        (["rl.loss_config={tis_cap = 'x'}"], r"loss config 'tis_cap' must be a number in \(0, 1e6\]"),
        (["rl.advantage=ppo"], r"advantage: expected one of \['grpo', 'rloo'\]"),
    ],
)
def test_losses_and_advantages_are_checked_against_the_one_list_of_names(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load(None, overrides)


def test_the_lists_of_names_match_what_they_name():
    from lockstep.advantages import ADVANTAGE_ESTIMATORS
    from lockstep.config.types import BUILTIN_ENVS, LOSSES
    from lockstep.envs.registry import resolve_factory
    from lockstep.losses import LOSS_CONFIG_KEYS

    assert {k: tuple(v) for k, v in LOSS_CONFIG_KEYS.items()} == LOSSES
    assert all(callable(resolve_factory(name)) for name in BUILTIN_ENVS)
    assert load(None, ["rl.advantage=rloo"]).stages[1].advantage in ADVANTAGE_ESTIMATORS
