"""A run whose components would compute different bits is refused (runtime/forwards.py).

One generator replica is put on the eager path, as on a node without the fused build: its Ray
actor gets LOCKSTEP_KERNELS=eager through its runtime_env (what `lockstep run` passes it is
otherwise the other replicas'), while the trainer runs the fused kernels. The run is refused
naming the replica and the `path` field; with runtime.allow_mixed_forward it runs and the
mismatch panel measures the difference. A replica that joins later or comes back from a restart
on the eager path is kept out of the fleet.
"""

import json
import shutil

import pytest
import ray

from lockstep.config import load
from lockstep.engine import kernels
from lockstep.runtime import run as run_module
from lockstep.runtime.forwards import MixedForward
from lockstep.runtime.plan import make_plan
from lockstep.runtime.run import build, generator_replica, resolve_model, run, start_ray, stop

RL = ["stages=[{kind = 'rl', steps = 3, prompts_per_step = 4, group_size = 4, eval_every = 100, learning_rate = 3e-4, "
      "max_seconds = 0, target_accuracy = 0.0, max_staleness = 0}]", "env.num_heldout=8", "env.pass_k=0",
      "runtime.checkpoint_every=0", "runtime.cpus=2", "seed=5"]
EAGER = {"env_vars": {"LOCKSTEP_KERNELS": "eager"}}


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    assert kernels.load() is not None, "these tests need the fused kernels built: python -m lockstep.engine.kernels"
    yield
    ray.shutdown()


def spec(model: str, *extra: str):
    return load(None, [*RL, f"model.path='{model}'", *extra])


def replica_env(monkeypatch, index: int, runtime_env: dict) -> None:
    """Generator replica `index` of the next runs starts with `runtime_env` (Ray merges its
    env_vars into the run's)."""
    def start(*args, **placement):
        return generator_replica(*args, **({**placement, "runtime_env": runtime_env} if args[3] == index else placement))

    monkeypatch.setattr(run_module, "generator_replica", start)


def live_actors(run_dir) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if str(run_dir) in a["name"]]


def until_restarted(actor, incarnation: str) -> None:
    """Return once Ray has restarted `actor` (it reports another incarnation)."""
    while True:
        try:
            if ray.get(actor.stats.remote(), timeout=120)["incarnation"] != incarnation:
                return
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
            pass  # this call reached the incarnation being killed; the next waits for the restart


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_run_with_an_eager_replica_is_refused_naming_the_path(tmp_path, builtin_dir, monkeypatch):
    d = tmp_path / "run"
    replica_env(monkeypatch, 1, EAGER)
    with pytest.raises(MixedForward) as refused:
        run(spec(builtin_dir, "rollout.replicas=2"), d)
    msg = str(refused.value)
    assert msg.startswith(f"generator1 would compute other bits than the trainer: path 'eager' vs 'fused', "
                          f"kernel_build '' vs '{kernels.tag()}', probe '")
    assert "generator would" not in msg  # the fused replica computes the trainer's bits
    assert "runtime.allow_mixed_forward = true" in msg
    assert not (d / "ledger.jsonl").exists() and not (d / "metrics.jsonl").exists()  # refused before any work
    assert live_actors(d) == []  # and its actors stopped
    # The control, without the forced path, is the start of the test below.


@pytest.mark.slow  # a whole run; the opt-in's policy is tested in test_forward_fingerprint.py
def test_with_the_opt_in_a_mixed_run_runs_and_measures_the_mismatch(tmp_path, builtin_dir, monkeypatch):
    d = tmp_path / "run"
    replica_env(monkeypatch, 1, EAGER)
    summary = run(spec(builtin_dir, "rollout.replicas=2", "runtime.allow_mixed_forward=true"), d)
    assert summary["counters"]["runtime/mixed_forward"] == 1 and min(summary["generator_requests"]) > 0
    report = json.loads((d / "forward.json").read_text())
    assert list(report["differences"]) == ["generator1"]
    assert report["differences"]["generator1"][0] == "path 'eager' vs 'fused'"
    assert report["components"]["generator1"]["path"] == "eager" and report["components"]["trainer"]["path"] == "fused"
    rl = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if "mismatch/abs_max" in r]
    # a synchronous run: with every replica on the trainer's forward each is 0.0 (as in
    # test_run_generator_replicas); here the eager replica's share of every batch shows
    assert len(rl) == 3 and all(r["mismatch/abs_max"] > 0.0 for r in rl)


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_replica_that_joins_or_restarts_on_another_forward_is_kept_out(tmp_path, builtin_dir, monkeypatch, caplog):
    """The allocator's new replica on the eager path is not added; a replica that Ray restarts on a
    node without the fused build (here: its kernels directory is gone when it restarts) is dropped."""
    own = tmp_path / "kernels"
    (own / kernels.tag()).mkdir(parents=True)
    shutil.copy(kernels._library(kernels.build_dir()), own / kernels.tag())
    s = spec(builtin_dir, "rollout.replicas=2")
    plan = make_plan(s)
    start_ray(plan)
    replica_env(monkeypatch, 1, {"env_vars": {kernels.DIR_ENV: str(own)}})
    c = build(s, plan, builtin_dir, tmp_path / "run")  # replica 1 loads the fused build from its own copy
    try:  # the control: components on one forward start (each computed its probe on its own)
        assert set(c.forwards) == {"trainer", "generator", "generator1"}
        assert len(set(c.forwards.values())) == 1 and c.forwards["trainer"].path == "fused"
        model = resolve_model(s)
        with caplog.at_level("WARNING", logger="lockstep.run"):
            index = c.fleet.new_index()
            c.start_generator(index, generator_replica(s, model, tmp_path / "run", index, 0, runtime_env=EAGER))
            assert c.poll_generators(block=True) == 0
            assert "generator2 is kept out of the run: generator2 would compute other bits than the trainer: " \
                   "path 'eager' vs 'fused'" in caplog.text
            assert list(c.fleet.live()) == ["generator", "generator1"] and c.stats["runtime/forward_refused"] == 1

            shutil.rmtree(own)
            actor = c.fleet.live()["generator1"]
            ray.kill(actor, no_restart=False)
            until_restarted(actor, c.incarnations["generator1"])
            c.recover()  # as after any loss: it came back on the eager path
            assert "generator1 is kept out of the run: generator1 would compute other bits than the trainer: " \
                   "path 'eager' vs 'fused'" in caplog.text
            assert list(c.fleet.live()) == ["generator"] and c.stats["runtime/forward_refused"] == 2
            assert c.stats["runtime/restarts"] == 1
    finally:
        stop(c)
