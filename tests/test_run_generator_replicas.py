"""`lockstep run rollout.replicas=N`: generator replicas behind the router (runtime/fleet.py).

A synchronous run is bit for bit the same for any number of replicas; an asynchronous run rolls
each new version out replica by replica and keeps the staleness bound and exact logprobs; a
replica that crashes is restarted and its groups replayed, and one out of restarts is dropped
while the run goes on with the others.
"""

import json
import threading
import time

import pytest
import ray
from safetensors.numpy import load_file

from lockstep.config import load
from lockstep.runtime.fleet import Router
from lockstep.runtime.ledger import audit
from lockstep.runtime.run import actor_name, run

RL = ["stages=[{kind = 'rl', steps = 6, prompts_per_step = 4, group_size = 4, eval_every = 100, learning_rate = 3e-4, "
      "max_seconds = 0, target_accuracy = 0.0, max_staleness = %d}]", "env.num_heldout=8", "env.pass_k=0",
      "runtime.checkpoint_every=0", "seed=5"]


def rl_spec(model: str, staleness: int, *extra: str):
    return load(None, [RL[0] % staleness, *RL[1:], f"model.path='{model}'", *extra])


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    ray.shutdown()


def records(d):
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


def rl_records(d):
    return [r for r in records(d) if "rollout/reward_mean" in r]


def check_exactly_once(d, steps: int, prompts: int = 4):
    """Every trained group trained once, each step a full batch, nothing left pending."""
    led = audit(d / "ledger.jsonl")
    assert led.pending() == []
    assert sorted(led.trained_step.values()) == sorted(s for s in range(1, steps + 1) for _ in range(prompts))
    return led


def weights(d):
    return load_file(str(d / "checkpoints" / "final" / "model.safetensors"))


def test_the_router_keeps_groups_even_and_skips_dropped_replicas():
    r = Router(3)
    assert r.assign(4) == (0, 1, 2, 0)
    r.release((1, 2))
    assert r.assign(3) == (1, 2, 1)  # the least loaded first, ties to the lowest index
    r.drop(1)
    assert set(r.assign(6)) == {0, 2}
    r.reset()
    assert r.assign(2) == (0, 2)
    r.drop(0), r.drop(2)
    with pytest.raises(RuntimeError, match="no generator replica is left"):
        r.assign(1)


def test_a_swap_mid_decode_stalls_its_replica_once_and_a_hold_stops_it(builtin_dir):
    """The replica-level mechanics of both weight syncs: weights parked mid-call are taken at the
    next decode step (until_swapped returns then), later tokens carry the new version, and the
    re-prefill is one measured stall; a hold stops decoding at a step boundary until release."""
    from lockstep.engine.types import SampleRequest, SamplingParams
    from lockstep.runtime.actors import GeneratorActor, TrainerActor
    from lockstep.runtime.plan import make_plan
    from lockstep.runtime.run import start_ray

    start_ray(make_plan(load(None, ["runtime.cpus=2"])))
    trainer = TrainerActor.options(num_cpus=0.5).remote(builtin_dir, 0, 32.0, 1)
    gen = GeneratorActor.options(num_cpus=0.5).remote(builtin_dir, 0, 32.0, 1)
    ray.get(trainer.start_fresh.remote())
    _, lineage, weights = trainer.publish.remote()
    lineage = ray.get(lineage)
    ray.get(gen.set_weights.remote(0, weights, time.time(), lineage))
    long = [SampleRequest((5, 6, 7), SamplingParams(max_tokens=480, temperature=1.0, stop=(), seed=3), num_samples=8)]

    def started(ref):
        deadline = time.time() + 60
        while not ray.get(gen.stats.remote())["sampling"]:
            assert time.time() < deadline and not ray.wait([ref], timeout=0)[0], "the call ended before the test acted"
            time.sleep(0.01)

    try:
        ref = gen.sample.remote(long)
        started(ref)
        ray.get(gen.set_weights.remote(1, weights, time.time(), lineage))
        assert ray.get(gen.until_swapped.remote(30), timeout=40)
        (result,) = ray.get(ref, timeout=120)
        s = ray.get(gen.stats.remote())
        assert s["version"] == 1 and s["stalls"] == 1 and s["stall_s_max"] > 0
        for seq in result.sequences:  # the tokens before the swap are version 0's, those after version 1's
            v = list(seq.token_versions)
            assert seq.policy_version == 0 and v == sorted(v) and set(v) == {0, 1}

        ref = gen.sample.remote(long)
        started(ref)
        ray.get(gen.hold.remote())
        assert ray.get(gen.until_held.remote(30), timeout=40)
        held_seen = time.perf_counter()  # CLOCK_MONOTONIC, the replica's clock too (same machine)
        s = ray.get(gen.stats.remote())
        assert s["held"] and s["sampling"] and not ray.wait([ref], timeout=0)[0]  # stopped mid-call, not ended
        released = time.perf_counter()
        ray.get(gen.release.remote())
        ray.get(ref, timeout=120)
        s = ray.get(gen.stats.remote())
        # The hold is one stall, and the replica's measure of it covers the whole hold the test saw.
        assert s["stalls"] == 2 and s["stall_s_max"] >= released - held_seen and not s["held"]
    finally:
        ray.kill(gen), ray.kill(trainer)


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_after_a_rollback_an_idle_replica_takes_the_new_branch_at_the_same_version(builtin_dir, tmp_path):
    """The trainer publishes version 1, rolls back to its version-0 checkpoint and publishes
    version 0 and then version 1 of another branch. A replica idle since the rollback holds only
    the last of them parked (each set_weights replaces the one before), the same version number
    as the discarded branch's weights in use: it must swap, and sample as a replica that only ever
    had the new branch's version 1 does."""
    from lockstep.engine.types import Datum, SampleRequest, SamplingParams
    from lockstep.runtime.actors import GeneratorActor, TrainerActor
    from lockstep.runtime.plan import make_plan
    from lockstep.runtime.run import start_ray

    start_ray(make_plan(load(None, ["runtime.cpus=2"])))
    trainer = TrainerActor.options(num_cpus=0.5).remote(builtin_dir, 0, 32.0, 1)
    gen, fresh = (GeneratorActor.options(num_cpus=0.5).remote(builtin_dir, 0, 32.0, 1) for _ in range(2))
    adam = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "grad_clip_norm": 1.0}
    request = [SampleRequest((5, 6, 7), SamplingParams(max_tokens=8, temperature=1.0, stop=(), seed=3))]

    def give(replica, published) -> None:
        version, lineage, weights = published
        ray.get(replica.set_weights.remote(ray.get(version), weights, time.time(), ray.get(lineage)))

    def sample(replica) -> list:
        (result,) = ray.get(replica.sample.remote(request))
        return [(s.tokens, s.logprobs, s.policy_version) for s in result.sequences]

    def train(tokens) -> None:
        ray.get(trainer.train.remote([Datum.from_tokens(tokens)], "cross_entropy", adam))

    try:
        ray.get(trainer.start_fresh.remote())
        ray.get(trainer.save_state.remote(str(tmp_path / "v0"), {}))
        train([5, 6, 7, 8, 9, 10, 11, 12])
        branch_a = trainer.publish.remote()
        give(gen, branch_a)
        discarded = sample(gen)  # the replica decodes under the first branch's version 1
        ray.get(trainer.load_state.remote(str(tmp_path / "v0")))  # the rollback
        give(gen, trainer.publish.remote())  # version 0 again, parked: the replica is idle
        train([5, 6, 7, 20, 21, 22, 23, 24])
        branch_b = trainer.publish.remote()
        give(gen, branch_b)  # replaces the parked version 0
        give(fresh, branch_b)
        want = sample(fresh)
        assert want != discarded  # the two branches' version 1 sample differently (the check can fail)
        assert sample(gen) == want
        s = ray.get(gen.stats.remote())
        assert s["version"] == 1 and s["lineage"] == ray.get(branch_b[1]) != ray.get(branch_a[1])
    finally:
        ray.kill(gen), ray.kill(fresh), ray.kill(trainer)


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_two_generator_replicas_equal_one_bit_for_bit(tmp_path, warm_dir):
    """Synchronous RL from a warmed-up model (rewards vary, so every step has a gradient): the
    replicas share out the groups, and the run is the one-replica run, bit for bit."""
    runs = {}
    for n in (1, 2):
        runs[n] = tmp_path / f"g{n}"
        summary = run(rl_spec(warm_dir, 0, f"rollout.replicas={n}"), runs[n])
        ray.shutdown()
        assert summary["generator_replicas"] == n
        assert len(summary["generator_requests"]) == n and min(summary["generator_requests"]) > 0
        check_exactly_once(runs[n], 6)
    one, two = weights(runs[1]), weights(runs[2])
    assert one.keys() == two.keys() and all((one[k] == two[k]).all() for k in one)
    a, b = rl_records(runs[1]), rl_records(runs[2])
    assert [r["rollout/reward_mean"] for r in a] == [r["rollout/reward_mean"] for r in b]
    assert any(r["train/grad_norm"] > 0 for r in b)
    assert {r["rollout/replicas"] for r in b} == {2}
    assert all(r["mismatch/abs_max"] == 0.0 for r in b)


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
@pytest.mark.parametrize("sync", ["rolling", "pause"])  # pause: the baseline
def test_an_async_run_over_two_replicas_keeps_the_staleness_bound_and_exact_logprobs(tmp_path, warm_dir, sync):
    d = tmp_path / "run"
    summary = run(rl_spec(warm_dir, 1, "rollout.replicas=2", f"rollout.weight_sync='{sync}'",
                          "stages.0.steps=8"), d)
    rl = rl_records(d)
    assert len(rl) == 8 and summary["generator_replicas"] == 2 and min(summary["generator_requests"]) > 0
    for r in rl:  # the bound holds across replicas, for every trained sample
        hist = {int(k.split("/")[1]): v for k, v in r.items() if k.startswith("staleness/")}
        assert sum(hist.values()) == 4 * 4 and max(hist) <= 1
    # A step of fresh samples only: the trainer recomputes exactly the sampler's logprobs, so the
    # version each token records is the one it was sampled under, whatever replica sampled it.
    fresh = [r for r in rl if r["rollout/staleness_max"] == 0]
    assert all(r["mismatch/abs_max"] == 0.0 for r in fresh)
    assert all(r["mismatch/abs_max"] > 0.0 for r in rl if r not in fresh)  # the others were off-policy
    # A replica is never more than one version behind the trainer when a step is logged.
    assert all(r["policy/trainer_version"] - r["policy/generator_version"] <= 1 for r in rl)
    check_exactly_once(d, 8)
    if sync == "pause":
        assert summary["counters"]["weights/fleet_pauses"] >= 7  # one per publication after the first step


def run_and_kill_replica(tmp_path, model, *extra, role="generator1"):
    """Run in a thread; after the second RL step, kill one generator replica in the middle of a
    sample call. A kill between its calls loses no group (the run only restarts it), and a decode
    call lasts tens of milliseconds, so the replica is first held (the fleet-wide pause's hold)
    inside a call, where it cannot return before the kill lands."""
    from lockstep.runtime.plan import make_plan
    from lockstep.runtime.run import start_ray

    d = tmp_path / "run"
    spec = rl_spec(model, 0, "rollout.replicas=2", "stages.0.steps=8", *extra)
    # Ray started from this (the main) thread: the GCS and raylet it starts die with the thread
    # that started them (PR_SET_PDEATHSIG follows the thread), which must outlive the run's.
    start_ray(make_plan(spec))
    out = {}
    thread = threading.Thread(target=lambda: out.update(summary=run(spec, d)))
    thread.start()
    deadline = time.time() + 180
    while time.time() < deadline and not out:
        if (d / "metrics.jsonl").exists() and len(rl_records(d)) >= 2:
            actor = ray.get_actor(actor_name(d, role))
            ray.get(actor.hold.remote(), timeout=60)
            ray.get(actor.until_held.remote(30), timeout=60)  # held in a call, or not sampling
            if ray.get(actor.stats.remote(), timeout=60)["held"]:
                ray.kill(actor, no_restart=False)
                break
            ray.get(actor.release.remote(), timeout=60)
        time.sleep(0.01)
    thread.join(timeout=300)
    assert "summary" in out, "the run did not finish after the replica was killed"
    return d, out["summary"]


@pytest.mark.slow  # two runs (~2 min); the default suite kills a replica in the test below
def test_a_crashed_replica_is_restarted_and_its_groups_replayed(tmp_path, warm_dir):
    reference = tmp_path / "reference"
    run(rl_spec(warm_dir, 0, "rollout.replicas=2", "stages.0.steps=8"), reference)
    ray.shutdown()
    d, summary = run_and_kill_replica(tmp_path, warm_dir)
    assert summary["counters"]["runtime/restarts"] >= 1 and summary["generator_replicas"] == 2
    check_exactly_once(d, 8)
    assert lost_with_the_replica(d)  # ... and replayed: every group trained exactly once
    got, want = weights(d), weights(reference)
    assert all((got[k] == want[k]).all() for k in want), first_difference(reference, d)  # the replay changed nothing


def lost_with_the_replica(d) -> list[str]:
    """The groups requeued because a component was lost (not the ones dynamic sampling regenerates)."""
    events = [json.loads(line) for line in (d / "ledger.jsonl").read_text().splitlines()]
    return [g for e in events if e["event"] == "requeued" and e.get("reason") == "component_restart" for g in e["ids"]]


def first_difference(reference, d) -> str:
    """Where a replayed run first left the reference: the step, the metrics that differ, the ledger's
    replays and the env failures logged (what a failure here needs to be traced)."""
    keys = ("rollout/reward_mean", "train/loss_sum", "train/grad_norm", "mismatch/abs_max", "rollout/staleness_max")
    for a, b in zip(rl_records(reference), rl_records(d)):
        diff = {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}
        if diff:
            led = audit(d / "ledger.jsonl")
            envs = (d / "envs.log").read_text()[-2000:] if (d / "envs.log").exists() else ""
            return (f"first difference at step {b['step']}: {diff}; replayed groups "
                    f"{ {g: n for g, n in led.attempts.items() if n > 1} }; envs.log: {envs!r}")
    return "the metrics of every step agree; only the final weights differ"


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_replica_out_of_restarts_is_dropped_and_the_run_goes_on(tmp_path, warm_dir, caplog):
    with caplog.at_level("WARNING", logger="lockstep.run"):
        d, summary = run_and_kill_replica(tmp_path, warm_dir, "runtime.max_restarts=0")
    assert summary["counters"]["runtime/generators_lost"] == 1 and summary["generator_replicas"] == 1
    assert "generator1 is out of restarts: going on with 1 generator replica(s)" in caplog.text
    check_exactly_once(d, 8)
    assert rl_records(d)[-1]["rollout/replicas"] == 1


def test_generator_replica_settings_are_checked_and_capped_for_jobs():
    from lockstep.config import ConfigError
    from lockstep.runtime.plan import make_plan
    from lockstep.service.policy import Limits, check_spec
    from lockstep.service.types import ServiceError

    with pytest.raises(ConfigError, match=r'rollout.replicas: expected an integer in \[1, 64\] or "auto"'):
        load(None, ["rollout.replicas=0"])
    with pytest.raises(ConfigError, match='rollout.weight_sync: expected "rolling" or "pause"'):
        load(None, ["rollout.weight_sync='sometimes'"])
    with pytest.raises(ServiceError, match="rollout.replicas = 9 is over this server's cap max_rollout_replicas = 4"):
        check_spec({"rollout": {"replicas": 9}}, Limits())
    assert check_spec({"rollout": {"replicas": "auto"}}, Limits()).rollout.replicas == "auto"
    with pytest.raises(ServiceError, match="rollout.max_replicas = 5 is over this server's cap max_rollout_replicas"):
        check_spec({"rollout": {"replicas": "auto", "max_replicas": 5}}, Limits())
    with pytest.raises(ConfigError, match=r"rollout.max_replicas: expected an integer in \[1, 64\]"):
        load(None, ["rollout.max_replicas=0"])
    plan = make_plan(load(None, ["rollout.replicas=2", "runtime.cpus=4"]))
    assert plan.generator_replicas == 2 and plan.generator_cpus == plan.trainer_cpus
    assert make_plan(load(None, ["rollout.replicas='auto'", "runtime.cpus=8"])).generator_replicas == 2
    assert make_plan(load(None, ["rollout.replicas='auto'", "runtime.cpus=2"])).generator_replicas == 1
    for cpus, most, want in [(2, 4, 2), (16, 4, 4), (16, 2, 2), (1, 4, 1)]:  # what the allocator may grow to
        p = make_plan(load(None, ["rollout.replicas='auto'", f"runtime.cpus={cpus}", f"rollout.max_replicas={most}"]))
        assert p.max_generator_replicas == want and p.generator_replicas <= want
    assert make_plan(load(None, ["rollout.replicas=3", "runtime.cpus=16"])).max_generator_replicas == 3  # as written
    for g, t, e, cpus in [(2, 2, 1, 2), (3, 1, 3, 2), (2, 3, 2, 7)]:  # never more than the budget: Ray would wait
        p = make_plan(load(None, [f"rollout.replicas={g}", f"train.replicas={t}", f"runtime.env_workers={e}",
                                  f"runtime.cpus={cpus}"]))
        assert g * p.generator_cpus + t * p.trainer_cpus + e * p.env_cpus <= cpus


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_the_allocator_grows_and_shrinks_the_fleet_without_losing_a_group(tmp_path, warm_dir, monkeypatch):
    """rollout.replicas = "auto" with the allocator's decisions scripted (its policy is tested on
    synthetic windows in test_allocator.py): a replica is started mid-run and routed to only once it
    holds the newest weights (its samples of a fresh step are exact), the window that measures it
    opens when it joins, and a retired replica is stopped once its groups are back."""
    from lockstep.runtime import stages
    from lockstep.runtime.allocator import Decision, Reason

    script = iter([2, 2, 1])  # replicas decided at the end of each window; then 1
    seen, routed = [], []

    class Scripted(stages.Allocator):
        def decide(self, w):
            seen.append(w.generator_replicas)
            return Decision(1, 1, next(script, 1), 1, 0, Reason.EXPLORE)

    assign = Router.assign
    monkeypatch.setattr(stages, "Allocator", Scripted)
    monkeypatch.setattr(Router, "assign", lambda self, n: routed.append(assign(self, n)) or routed[-1])
    d = tmp_path / "run"
    summary = run(rl_spec(warm_dir, 1, "rollout.replicas='auto'", "runtime.cpus=2", "runtime.allocator_window=2",
                          "stages.0.steps=150"), d)
    counters = summary["counters"]
    assert counters["alloc/generator_replicas_started"] == 1 and counters["alloc/generator_replicas_stopped"] == 1
    assert seen[:4] == [1, 2, 2, 1]  # the window after the decision to grow measured 2 replicas
    assert any(1 in r for r in routed)  # the new replica sampled groups
    rl = rl_records(d)
    assert {r["rollout/replicas"] for r in rl} == {1, 2} and rl[-1]["rollout/replicas"] == 1
    assert summary["generator_replicas"] == 1
    for r in rl:  # the staleness bound held through the resizes, and fresh steps are exact
        assert r["rollout/staleness_max"] <= 1
        assert r["rollout/staleness_max"] > 0 or r["mismatch/abs_max"] == 0.0
    check_exactly_once(d, 150)
