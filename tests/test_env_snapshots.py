"""Snapshots of every built-in env: a restored episode (in a fresh env of the same problem) given the
same actions yields the same observations and rewards; a snapshot of another env type, or from
another lockstep version, is refused with a clear error."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle

import pytest
from transformers import AutoTokenizer

from lockstep.config.types import EnvSpec
from lockstep.envs.registry import make_suite
from lockstep.envs.types import EnvError, EnvSnapshot
from lockstep.sandbox.types import Limits

FAST = Limits(wall_s=3, cpu_s=1, memory_mb=256)


@pytest.fixture(scope="module")
def tok(builtin_dir):
    return AutoTokenizer.from_pretrained(builtin_dir)


def specs(tmp_path):
    math_rows = tmp_path / "math.jsonl"
    math_rows.write_text("".join(json.dumps({"problem": f"{a}+1", "answer": str(a + 1)}) + "\n" for a in range(8)))
    return {
        "arithmetic": (EnvSpec(name="arithmetic", max_turns=3, num_heldout=4), ["9", "12"], "final"),
        "long_addition": (EnvSpec(name="long_addition", max_turns=2, num_heldout=4), ["1+2"], "final"),
        "math": (EnvSpec(name="math", path=str(math_rows), num_heldout=2), [], "final"),
        "reasoning_gym": (EnvSpec(name="reasoning_gym", task="basic_arithmetic", size=10, num_heldout=2), [], "final"),
        "code": (EnvSpec(name="code", num_heldout=4, sandbox=FAST), [], "def f(x):\n    return x\n```"),
        "python_tool": (EnvSpec(name="python_tool", size=10, num_heldout=2, max_turns=4, sandbox=FAST),
                        ["<python>import random\nxs = [random.random() for _ in range(3)]\nprint(sorted({'b', 'a', 'c'}))</python>",
                         "<python>total = sum(xs)</python>"], "<python>print(total, xs)</python>"),
    }


@pytest.mark.parametrize("name", ["arithmetic", "long_addition", "math", "reasoning_gym", "code", "python_tool"])
def test_snapshot_restore_round_trip(tmp_path, tok, name):
    spec, before, after = specs(tmp_path)[name]
    suite = make_suite(spec, tok, seed=0)
    builder = suite.train(2).get_batch(0)[0]

    async def go():
        env = builder.make_envs(1, tok)[0]
        obs = await env.initial_observation()
        for text in before:
            r = await env.step(tok.encode(text))
            assert not r.episode_done
        snap = pickle.loads(pickle.dumps(env.snapshot()))  # it crosses processes (Ray) as a pickle
        assert isinstance(snap, EnvSnapshot)
        last = tok.encode(after)
        original = await env.step(last)
        fresh = builder.make_envs(1, tok)[0]
        fresh.restore(snap)
        replayed = await fresh.step(last)
        assert dataclasses.astuple(replayed) == dataclasses.astuple(original)
        env.restore(snap)  # and back into the env it came from
        again = await env.step(last)
        assert dataclasses.astuple(again) == dataclasses.astuple(original)
        return obs, snap

    obs, snap = asyncio.run(go())
    other = make_suite(EnvSpec(name="code" if name in ("arithmetic", "long_addition") else "arithmetic", num_heldout=4, sandbox=FAST),
                       tok, seed=0).train(1).get_batch(0)[0].make_envs(1, tok)[0]
    with pytest.raises(EnvError, match="this snapshot is of a .* env; restore it into an env of that type"):
        other.restore(snap)
    old = dataclasses.replace(snap, lockstep="0.0.1")
    with pytest.raises(EnvError, match="taken by lockstep 0.0.1"):
        builder.make_envs(1, tok)[0].restore(old)
    with pytest.raises(EnvError, match="expected an EnvSnapshot"):
        builder.make_envs(1, tok)[0].restore((1, 2))
