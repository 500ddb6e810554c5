"""The `python_tool` env: tool calls run in one sandboxed interpreter per episode (state kept across
turns), outputs come back as env-inserted tokens, answers are graded; snapshots replay the cells."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from lockstep.config.types import EnvSpec
from lockstep.envs import python_tool
from lockstep.envs.registry import make_suite
from lockstep.sandbox.types import Limits

FAST = Limits(wall_s=2, cpu_s=1, memory_mb=256)


@pytest.fixture(scope="module")
def tok(builtin_dir):
    return AutoTokenizer.from_pretrained(builtin_dir)


@pytest.fixture(scope="module")
def suite(tok):
    return make_suite(EnvSpec(name="python_tool", num_heldout=5, size=50, max_turns=4, sandbox=FAST), tok, seed=0)


def test_tool_calls_keep_state_and_outputs_are_inserted(suite, tok):
    b = suite.train_builder("g", 0)

    async def go():
        env = b.make_envs(1, tok)[0]
        obs = await env.initial_observation()
        assert obs.stop == python_tool.STOPS and obs.max_tokens >= 64
        a1 = tok.encode("<python>x = 6\nprint(x * 7)</python>")
        r1 = await env.step(a1)
        assert not r1.episode_done and r1.reward == 0.0
        context = obs.tokens + tuple(a1)
        assert r1.next_observation.tokens[:len(context)] == context  # extends the context and the action
        assert tok.decode(list(r1.next_observation.tokens[len(context):])) == "\n<output>\n42\n</output>\n"
        a2 = tok.encode("<python>x + 1</python>")  # the interpreter kept x; a final expression is shown
        r2 = await env.step(a2)
        assert tok.decode(list(r2.next_observation.tokens[-30:])).endswith("\n<output>\n7\n</output>\n")
        r3 = await env.step(tok.encode(f"<answer>{b.problem.answer}</answer>"))
        assert r3.episode_done and r3.reward == 1.0
        assert r3.metrics == {"correct": 1.0, "tool_calls": 2.0, "tool_errors": 0.0, "tool_replay_mismatch": 0.0}

    asyncio.run(go())


def test_errors_timeouts_and_the_turn_limit(suite, tok):
    b = suite.train_builder("g", 1)

    async def go():
        env = b.make_envs(1, tok)[0]
        await env.initial_observation()
        r = await env.step(tok.encode("<python>1/0</python>"))
        assert "ZeroDivisionError" in tok.decode(list(r.next_observation.tokens))
        r = await env.step(tok.encode("<python>while True: pass</python>"))
        assert "[stopped: " in tok.decode(list(r.next_observation.tokens[-40:]))
        r = await env.step(tok.encode("<python>print(1)</python>"))
        assert not r.episode_done
        r = await env.step(tok.encode("<python>print(2)</python>"))  # the 4th turn: the limit, unanswered
        assert r.episode_done and r.reward == 0.0 and r.metrics["tool_calls"] == 3.0 and r.metrics["tool_errors"] == 2.0
        env2 = b.make_envs(1, tok)[0]
        await env2.initial_observation()
        r = await env2.step(tok.encode("I think it is 5"))  # neither a call nor an answer: ends unanswered
        assert r.episode_done and r.reward == 0.0 and r.metrics["tool_calls"] == 0.0

    asyncio.run(go())


def test_a_killed_interpreter_is_rebuilt_from_its_cells(suite, tok):
    """A call that times out kills the interpreter; the next call gets a fresh one with the earlier
    cells replayed, so the state the model built survives."""
    b = suite.train_builder("g", 2)

    async def go():
        env = b.make_envs(1, tok)[0]
        await env.initial_observation()
        await env.step(tok.encode("<python>import random\nv = random.random()\nsecret = 'kept'</python>"))
        await env.step(tok.encode("<python>import time\ntime.sleep(30)</python>"))
        r = await env.step(tok.encode("<python>print(secret)</python>"))
        assert tok.decode(list(r.next_observation.tokens)).endswith("<output>\nkept\n</output>\n")
        assert env.mismatches == 0
        env.close()

    asyncio.run(go())


def test_procedural_problems_and_warm_up_transcripts(suite, tok):
    assert len(suite.problems) == 50 and len(suite.heldout_problems) == 5
    assert {p.question for p in suite.problems}.isdisjoint(p.question for p in suite.heldout_problems)
    for k in range(10):
        question, transcript = suite.solved(k)
        expr = transcript.split("<python>print(")[1].split(")</python>")[0]
        assert str(eval(expr)) == suite.problems[k].answer  # the transcript's tool call computes the answer
        assert transcript.endswith(f"<answer>{suite.problems[k].answer}</answer>")


def test_only_model_written_tokens_are_trained(suite, tok):
    """Through the episode machinery, with a scripted policy: the tool call and the answer are
    sampled tokens (trained, with their logprobs); the tool's output is env-inserted (weight 0)."""
    from lockstep.engine.types import SampledSequence, SampleResult
    from lockstep.runtime.episodes import run_episodes
    from lockstep.runtime.filters import to_datums
    from lockstep.runtime.types import RolloutRequest

    builder = suite.train_builder("g", 3)
    script = [f"<python>print({python_tool._expression(builder.problem.question)})</python>",
              f"<answer>{builder.problem.answer}</answer>"]
    turns = []

    async def sample(requests, groups):
        text = script[len(turns)]
        turns.append(requests)
        ids = tuple(tok.encode(text))
        return [SampleResult(tuple(SampledSequence(ids, (-0.25,) * len(ids), "stop", 0) for _ in range(r.num_samples)))
                for r in requests]

    req = RolloutRequest(("g",), (builder,), 2, 1.0, 0)
    (group,), _ = asyncio.run(run_episodes(req, tok, sample, retries=0, timeout_s=10))
    call, answer = (tok.encode(t) for t in script)
    inserted = tok.encode(f"\n<output>\n{builder.problem.answer}\n</output>\n")
    for s in group.samples:
        assert s.reward == 1.0 and s.turns == 2
        assert list(s.tokens) == call + inserted + answer
        assert list(s.sampled) == [True] * len(call) + [False] * len(inserted) + [True] * len(answer)
    data, starts = to_datums([group])
    for d, k in zip(data, starts):
        assert list(d.loss_fn_inputs["weights"][k:]) == [1.0] * len(call) + [0.0] * len(inserted) + [1.0] * len(answer)
