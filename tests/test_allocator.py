"""The closed-loop allocator (runtime/allocator.py): its decisions on synthetic windows, its CPU
request as the Ray autoscaler reads it, and an asynchronous `lockstep run` that it re-plans while
every prompt group is still trained exactly once."""

import json

import pytest
import ray

from lockstep.config import ConfigError, load
from lockstep.runtime.allocator import (MAX_RETRY_EVERY, RETRY_EVERY, Allocator, Reason, Window)
from lockstep.runtime.ledger import audit
from lockstep.runtime.run import run


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    ray.shutdown()


def window(rate=4.0, *, trainer=0.5, generator=0.5, env=0.05, completion=10.0, budget=2, cluster=2,
           replicas=1) -> Window:
    return Window(steps_per_s=rate, sampled_tokens_per_s=rate * 320, completion_tokens=completion,
                  trainer_busy=trainer, generator_busy=generator, env_busy=env, in_flight_batches=2.0,
                  buffered_groups=0.0, budget_cpus=budget, cluster_cpus=cluster, generator_replicas=replicas)


def drive(a: Allocator, rates: dict, windows: int, **kw) -> list:
    """`windows` decisions, each window's step rate that of the plan it ran under."""
    return [a.decide(window(rates[a.current], **kw)) for _ in range(windows)]


def test_threads_move_towards_the_bottleneck_and_stay_if_faster():
    a = Allocator(2)
    assert a.current == (1, 1)  # the even split first
    d = a.decide(window(4.0, trainer=0.95, generator=0.4))  # the generator waits on the trainer
    assert (d.plan, d.reason) == ((2, 1), Reason.EXPLORE)
    d = a.decide(window(5.0, trainer=0.8, generator=0.6))  # 25% faster: kept
    assert (d.plan, d.reason) == ((2, 1), Reason.ACCEPT)

    a = Allocator(2)
    d = a.decide(window(4.0, trainer=0.3, generator=0.97))  # the trainer waits on the generator
    assert (d.plan, d.reason) == ((1, 2), Reason.EXPLORE)
    d = a.decide(window(4.1))  # 2.5% is within noise: back to the even split
    assert (d.plan, d.reason) == ((1, 1), Reason.REVERT)


def test_flat_rates_settle_instead_of_oscillating():
    a = Allocator(2)
    decisions = drive(a, {(1, 1): 4.0, (1, 2): 4.0, (2, 1): 4.0}, 200)
    trials = [i for i, d in enumerate(decisions) if d.reason in (Reason.EXPLORE, Reason.RETRY)]
    assert [decisions[i].reason for i in trials[:2]] == [Reason.EXPLORE, Reason.EXPLORE]
    # every failed retry doubles the wait: 6, 12, 24, 48, 48 windows for each of the two rungs
    assert len(trials) <= 2 + 2 * (1 + (200 - RETRY_EVERY) // MAX_RETRY_EVERY + 3)
    assert sum(d.plan != (1, 1) for d in decisions[100:]) <= 2 * (100 // MAX_RETRY_EVERY + 1)
    assert decisions[-1].plan == (1, 1) or decisions[-1].reason == Reason.RETRY


def test_the_fastest_plan_wins_and_a_slower_machine_is_followed():
    a = Allocator(2)
    drive(a, {(1, 1): 4.0, (1, 2): 3.0, (2, 1): 5.0}, 10)
    assert a.current == (2, 1)
    drive(a, {(1, 1): 6.0, (1, 2): 3.0, (2, 1): 2.5}, 30)  # the machine changed: (2, 1) got slow
    assert a.current == (1, 1)


def test_no_thread_trial_while_the_loop_waits_on_something_else():
    a = Allocator(2)
    decisions = [a.decide(window(4.0, trainer=0.3, generator=0.4)) for _ in range(20)]
    assert {(d.plan, d.reason) for d in decisions} == {((1, 1), Reason.HOLD)}
    d = a.decide(window(4.0, trainer=0.3, generator=0.7))  # now the trainer waits on the generator
    assert (d.plan, d.reason) == ((1, 2), Reason.EXPLORE)


def test_env_workers_are_added_when_generation_waits_on_rewards_and_retired_when_idle():
    a = Allocator(2, env_workers=1, max_env_workers=3)
    d = a.decide(window(env=0.9, generator=0.3))
    assert (d.env_workers, d.reason, d.plan) == (2, Reason.ENV_ADD, (1, 1))  # no thread trial in the same window
    assert a.decide(window(env=0.8, generator=0.3)).env_workers == 3
    assert a.decide(window(env=0.95, generator=0.3)).env_workers == 3  # capped
    assert a.decide(window(env=0.9, generator=0.9)).env_workers == 3  # the generator is busy: envs are not the wait
    d = a.decide(window(env=0.1))
    assert (d.env_workers, d.reason) == (2, Reason.ENV_RETIRE)
    assert a.decide(window(env=0.1)).env_workers == 1
    assert a.decide(window(env=0.0)).env_workers == 1  # never below one
    b = Allocator(2, env_workers=2, max_env_workers=2)
    assert b.decide(window(env=0.2)).env_workers == 2  # 0.2 * 2 / 1 = 0.4 >= 0.3: one alone would be too busy


def test_longer_completions_make_it_plan_again():
    a = Allocator(2)
    rates = {(1, 1): 4.0, (1, 2): 3.0, (2, 1): 3.0}
    drive(a, rates, 6)
    assert a.current == (1, 1) and len(a.rates) == 3  # every rung measured
    d = a.decide(window(4.0, completion=20.0, generator=0.95, trainer=0.5))  # completions doubled
    assert d.reason == Reason.REPLAN and d.plan == (1, 2)  # forgotten, and towards the busy generator
    assert set(a.rates) == {a.home}  # the other rungs' rates are forgotten
    d = a.decide(window(5.0, completion=20.0, generator=0.9))
    assert (d.plan, d.reason) == ((1, 2), Reason.ACCEPT)
    d = a.decide(window(5.0, completion=22.0, generator=0.9))  # 10% longer: within DRIFT
    assert d.reason != Reason.REPLAN


def test_more_cpus_are_asked_for_only_when_threads_cannot_help_and_given_back_when_idle():
    a = Allocator(2)
    busy = {"trainer": 0.97, "generator": 0.5, "cluster": 4}
    d = a.decide(window(4.0, **busy))
    assert d.request_cpus == 0 and d.plan == (2, 1)  # a rung towards the trainer is left: try it first
    d = a.decide(window(5.0, **busy))
    assert d.plan == (2, 1) and d.request_cpus == 3  # the trainer has the most threads: budget 2 + 1
    assert a.decide(window(5.0, **busy)).request_cpus == 3  # kept while needed
    assert a.decide(window(5.0, trainer=0.2, generator=0.2, cluster=4)).request_cpus == 3  # one window may be noise
    assert a.decide(window(5.0, trainer=0.2, generator=0.2, cluster=4)).request_cpus == 0  # idle: given back
    c = Allocator(2)
    c.decide(window(4.0, trainer=0.97, generator=0.95, cluster=2))
    assert c.decide(window(4.0, trainer=0.97, generator=0.95, cluster=2)).request_cpus == 0  # no CPU to ask for
    assert c.decide(window(4.0, trainer=0.97, generator=0.95, cluster=8)).request_cpus == 3  # both saturated


def test_the_cpu_request_reaches_the_autoscaler():
    """What `request_resources` stores for the autoscaler to read: with the default (v1)
    autoscaler, a list of 1-CPU bundles under GCS's internal KV key; no autoscaler is running
    here, so the cluster itself does not grow."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    from lockstep import raylocal
    from lockstep.runtime.controller import Components

    ray.shutdown()
    raylocal.init("", num_cpus=2, log_to_driver=False)
    assert not is_autoscaler_v2()
    c = Components(trainer=None, fleet=None, envs=[], timeout=30)
    c.request_cpus(3)
    assert json.loads(_internal_kv_get("autoscaler_resource_request")) == [{"CPU": 1}] * 3
    c.request_cpus(0)
    assert json.loads(_internal_kv_get("autoscaler_resource_request")) == []
    ray.shutdown()


def test_config_switches_are_checked():
    assert load(None, []).runtime.allocator is True
    with pytest.raises(ConfigError, match="runtime.allocator_window: expected an integer >= 1"):
        load(None, ["runtime.allocator_window=0"])
    with pytest.raises(ConfigError, match="runtime.allocator: expected bool"):
        load(None, ["runtime.allocator=1"])


STEPS, PROMPTS, WINDOW = 24, 4, 4
RL = [f"stages=[{{kind = 'rl', steps = {STEPS}, prompts_per_step = {PROMPTS}, group_size = 4, eval_every = 12, "
      "learning_rate = 3e-4, max_seconds = 0, target_accuracy = 0.0, max_staleness = 1}]", "env.num_heldout=8",
      "env.pass_k=0", "runtime.checkpoint_every=0", "runtime.cpus=2", "runtime.env_workers=6",
      f"runtime.allocator_window={WINDOW}", "seed=3"]


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_an_async_run_is_replanned_and_trains_every_group_once(tmp_path, builtin_dir):
    d = tmp_path / "alloc"
    run(load(None, [*RL, f"model.path='{builtin_dir}'"]), d)
    ray.shutdown()
    records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    decisions = [r for r in records if "alloc/reason" in r]
    assert len(decisions) == STEPS // WINDOW
    assert all(isinstance(v, (int, float)) for r in decisions for k, v in r.items() if k.startswith("alloc/"))
    # six env workers are far more than arithmetic's rewards (at most two batches in flight) need:
    # they are retired one a window, each after draining its rollouts
    assert decisions[0]["alloc/env_workers"] == 5 and decisions[0]["alloc/reason"] == Reason.ENV_RETIRE
    assert decisions[-1]["alloc/env_workers"] < 5
    assert all(r["alloc/retiring_env_workers"] <= 1 for r in decisions)  # each drained within its window
    assert all(r["alloc/requested_cpus"] == 0 for r in decisions)  # the cluster is the budget: nothing to ask
    led = audit(d / "ledger.jsonl")
    assert led.pending() == []
    assert sorted(led.trained_step.values()) == sorted(s for s in range(1, STEPS + 1) for _ in range(PROMPTS))


def test_replicas_are_a_second_axis_when_the_fleet_may_resize():
    """rollout.replicas = "auto": towards a busy generator, a rung down first, then one replica more;
    each kept only if measured faster. A fixed count is never changed."""
    a = Allocator(2, generator_replicas=1, max_generator_replicas=2)
    gen_bound = {"trainer": 0.3, "generator": 0.97}
    d = a.decide(window(4.0, **gen_bound))
    assert (d.plan, d.generator_replicas, d.reason) == ((1, 2), 1, Reason.EXPLORE)  # threads first
    d = a.decide(window(4.0, **gen_bound))
    assert (d.plan, d.generator_replicas, d.reason) == ((1, 1), 1, Reason.REVERT)
    d = a.decide(window(4.0, **gen_bound))
    assert (d.plan, d.generator_replicas, d.reason) == ((1, 1), 2, Reason.EXPLORE)  # then a replica more
    d = a.decide(window(5.0, **gen_bound, replicas=2))
    assert (d.plan, d.generator_replicas, d.reason) == ((1, 1), 2, Reason.ACCEPT)
    assert d.metrics()["alloc/generator_replicas"] == 2 and d.metrics()["alloc/generator_threads_per_replica"] == 1
    # the trainer now waits: a rung up, or a replica fewer; the replica fewer was slower before
    d = a.decide(window(5.0, trainer=0.97, generator=0.4, replicas=2))
    assert (d.plan, d.generator_replicas) == ((2, 1), 2)
    d = a.decide(window(4.0, trainer=0.97, generator=0.4, replicas=2))
    assert (d.plan, d.generator_replicas, d.reason) == ((1, 1), 2, Reason.REVERT)

    fixed = Allocator(2, generator_replicas=2)
    decisions = [fixed.decide(window(4.0 + i % 3, **gen_bound, replicas=2)) for i in range(40)]
    assert {d.generator_replicas for d in decisions} == {2}


def test_a_replica_lost_for_good_shrinks_the_range():
    a = Allocator(4, generator_replicas=1, max_generator_replicas=3)
    a.home = (a.home[0], 3)
    d = a.decide(window(4.0, replicas=2, budget=4, cluster=4))  # one out of restarts
    assert (d.generator_replicas, d.reason) == (2, Reason.REPLICA_LOST)
    assert a.replica_range == (1, 2)
    decisions = [a.decide(window(4.0 + i % 2, trainer=0.2, generator=0.99, replicas=a.replicas, budget=4, cluster=4))
                 for i in range(60)]
    assert max(d.generator_replicas for d in decisions) == 2  # it never tries to replace the lost one
