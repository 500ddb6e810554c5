"""Episodes: env turns interleaved with batched sampling on the real engine sampler (no Ray)."""

import asyncio
import logging
from dataclasses import dataclass

import numpy as np
import pytest

from lockstep.engine.sampler import Sampler
from lockstep.engine.trainer import Trainer
from lockstep.envs.arithmetic import FEEDBACK, ArithmeticGroupBuilder, Problem
from lockstep.envs.types import Observation, StepResult
from lockstep.runtime import episodes
from lockstep.runtime.episodes import RateLimitedLog, run_episodes
from lockstep.runtime.filters import to_datums
from lockstep.runtime.types import RolloutRequest


@pytest.fixture(scope="module")
def engine(builtin_dir):
    trainer = Trainer.from_pretrained(builtin_dir)
    return trainer, Sampler(trainer.model, trainer.tokenizer)


def roll(engine, builders, group_size, *, temperature=1.0, retries=1, timeout_s=5.0, seen=None, fork=(0, 1)):
    trainer, sampler = engine

    async def sample(requests, groups):
        if seen is not None:
            seen.append(requests)
        return sampler.sample(requests)

    req = RolloutRequest(tuple(b.group_id for b in builders), tuple(builders), group_size, temperature, 7, *fork)
    groups, _ = asyncio.run(run_episodes(req, trainer.tokenizer, sample, retries=retries, timeout_s=timeout_s))
    return groups


def test_a_group_shares_one_request_and_is_scored(engine):
    seen = []
    (g,) = roll(engine, [ArithmeticGroupBuilder("g", Problem(1, 2, 3), max_tokens=6)], 4, seen=seen)
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0].num_samples == 4  # prefix shared
    tok = engine[0].tokenizer
    assert g.prompt == tuple(tok.encode("001+002=")) and len(g.samples) == 4 and g.failed == 0
    for s in g.samples:
        assert len(s.tokens) == len(s.logprobs) >= 1 and s.sampled == () and s.turns == 1
        assert s.reward == float(tok.decode(list(s.tokens)) == "0003" + tok.eos_token)


def test_multi_turn_episode_is_one_sequence_with_exact_logprobs(engine):
    trainer, _ = engine
    tok = trainer.tokenizer
    (g,) = roll(engine, [ArithmeticGroupBuilder("m", Problem(123, 456, 3), max_tokens=6, max_turns=2)], 3)
    retry = tok.encode(FEEDBACK + "123+456=")
    for s in g.samples:  # the untrained model answers wrong twice
        assert s.turns == 2 and s.reward == 0.0 and s.metrics == {"correct": 0.0, "turns": 2.0}
        n1 = s.sampled.index(False)
        assert list(s.tokens[n1 : n1 + len(retry)]) == retry  # feedback + prompt, inserted by the env
        assert not any(s.sampled[n1 : n1 + len(retry)]) and all(s.sampled[n1 + len(retry):])
    # The trainer recomputes every sampled token's logprob exactly, env tokens and all in context.
    data, starts = to_datums([g])
    out = trainer.forward(data)
    for d, o, k in zip(data, out.loss_fn_outputs, starts):
        keep = d.loss_fn_inputs["weights"][k:] > 0
        np.testing.assert_array_equal(o["logprobs"][k:][keep], d.loss_fn_inputs["logprobs"][k:][keep])


@dataclass
class FlakyEnv:
    """Raises on its first `failures` steps; mutates its state before raising (restore undoes it)."""

    failures: int
    hang: bool = False
    state: int = 0
    calls: int = 0

    async def initial_observation(self):
        return Observation((5, 6, 7), None, 2)

    async def step(self, action):
        self.calls += 1
        self.state += 1
        if self.hang:
            await asyncio.sleep(30)
        if self.calls <= self.failures:
            raise RuntimeError("flaky")
        return StepResult(float(self.state), True, metrics={"correct": 1.0})

    def snapshot(self):
        return self.state

    def restore(self, snap):
        self.state = snap


@dataclass(frozen=True)
class FlakyBuilder:
    group_id: str
    failures: int
    hang: bool = False

    def make_envs(self, group_size, tokenizer):
        return [FlakyEnv(self.failures, self.hang) for _ in range(group_size)]


def test_env_failures_are_retried_from_a_snapshot_then_counted(engine):
    ok, broken, hung = roll(engine, [FlakyBuilder("ok", 1), FlakyBuilder("broken", 5), FlakyBuilder("hung", 0, True)],
                            2, retries=1, timeout_s=0.2)
    assert ok.failed == 0 and [s.reward for s in ok.samples] == [1.0, 1.0]  # state restored before the retry
    assert broken.failed == 2 and hung.failed == 2  # every retry failed or timed out: counted, not raised


def test_env_failures_are_logged_with_their_traceback_at_a_bounded_rate(engine, caplog, monkeypatch):
    limiter = RateLimitedLog(logging.getLogger("lockstep.envs"), burst=5, window_s=60.0)
    monkeypatch.setattr(episodes, "env_errors", limiter)
    with caplog.at_level(logging.ERROR, logger="lockstep.envs"):
        (g,) = roll(engine, [FlakyBuilder("broken", 100)], 8, retries=1)  # 8 episodes x 2 tries
        assert g.failed == 8
        logged = [r for r in caplog.records if r.name == "lockstep.envs"]
        assert len(logged) == 5  # the first five, each with the env's own exception and traceback
        assert all(isinstance(r.exc_info[1], RuntimeError) and str(r.exc_info[1]) == "flaky" for r in logged)
        assert logged[0].getMessage() == "FlakyEnv.step raised (try 1 of 2)"
        assert "in step" in caplog.text and 'raise RuntimeError("flaky")' in caplog.text
        limiter.window_start -= 60  # the window ends: the next failure says how many were left out
        caplog.clear()
        roll(engine, [FlakyBuilder("broken", 100)], 1, retries=0)
    assert [r.getMessage().split(" in the last")[0] for r in caplog.records] == [
        "11 more env failures", "FlakyEnv.step raised (try 1 of 1)"]


@dataclass(frozen=True)
class ForgetfulBuilder:
    """A two-turn env whose second observation does not extend the first context."""

    group_id: str

    def make_envs(self, group_size, tokenizer):
        class Env:
            async def initial_observation(self):
                return Observation((5, 6), None, 2)

            async def step(self, action):
                return StepResult(0.0, False, Observation((9, 9, 9), None, 2))

        return [Env() for _ in range(group_size)]


def test_a_next_observation_must_extend_the_context(engine):
    (g,) = roll(engine, [ForgetfulBuilder("f")], 2)
    assert g.failed == 2


def test_forked_episodes_share_their_prefix_and_train_it_once(engine):
    """After turn 1 each live episode is snapshotted and continued as 3 branches: they share the
    prefix tokens (one sampling request per family, so one prefill), exactly one branch trains the
    prefix, and the trainer still recomputes every trained token's logprob exactly."""
    trainer, _ = engine
    seen = []
    (g,) = roll(engine, [ArithmeticGroupBuilder("f", Problem(123, 456, 3), max_tokens=6, max_turns=3)], 2,
                seen=seen, fork=(1, 3))
    assert len(g.samples) == 6 and g.failed == 0  # the untrained model is wrong on turn 1: every episode forks
    families = {}
    for s in g.samples:
        families.setdefault(s.family, []).append(s)
    assert sorted(families) == [0, 1] and all(len(f) == 3 for f in families.values())
    for f in families.values():
        cut = f[0].fork_at
        assert cut > 0 and all(s.fork_at == cut and s.tokens[:cut] == f[0].tokens[:cut] for s in f)
        assert sum(s.owns_prefix for s in f) == 1
    assert [r.num_samples for r in seen[1]] == [3, 3]  # turn 2: one request per family
    data, starts = to_datums([g])
    for d, s, k in zip(data, g.samples, starts):
        w = d.loss_fn_inputs["weights"][k:]
        assert (w[:s.fork_at] > 0).any() == s.owns_prefix  # the prefix is trained in one branch only
    out = trainer.forward(data)
    for d, o, k in zip(data, out.loss_fn_outputs, starts):
        keep = d.loss_fn_inputs["weights"][k:] > 0
        np.testing.assert_array_equal(o["logprobs"][k:][keep], d.loss_fn_inputs["logprobs"][k:][keep])
