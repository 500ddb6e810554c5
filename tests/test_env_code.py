"""The `code` env: completions parsed as programs, graded by their tests in the sandbox; rows with
malformed tests counted and skipped; timeouts, crashes and violations counted apart."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from lockstep.config import load
from lockstep.config.types import ConfigError, EnvSpec
from lockstep.envs import code as code_env
from lockstep.envs.registry import make_suite
from lockstep.envs.types import EnvError
from lockstep.sandbox.types import Limits

FAST = Limits(wall_s=3, cpu_s=1, memory_mb=256)


@pytest.fixture(scope="module")
def tok(builtin_dir):
    return AutoTokenizer.from_pretrained(builtin_dir)


def step(builder, tok, completion):
    async def go():
        env = builder.make_envs(1, tok)[0]
        await env.initial_observation()
        return await env.step(tok.encode(completion) + [tok.eos_token_id])

    return asyncio.run(go())


def test_parse_code_from_fences_and_plain_text():
    assert code_env.parse_code("def f():\n    return 1\n```\nprose", fence_open=True) == "def f():\n    return 1\n"
    assert code_env.parse_code("Here:\n```python\nx = 1\n```\nand more", fence_open=False) == "x = 1\n"
    assert code_env.parse_code("```\ny = 2\n", fence_open=False) == "y = 2\n"  # an unclosed block
    assert code_env.parse_code("z = 3", fence_open=False) == "z = 3"  # plain code


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_reward_is_the_share_of_tests_passed_or_all_or_nothing(tmp_path, tok):
    row = {"prompt": "Write `inc(x)`.", "entry_point": "inc", "solution": "def inc(x):\n    return x + 1\n",
           "tests": ["assert inc(1) == 2", "assert inc(-1) == 0", "assert inc(10) == 11", "assert inc(0) == 1"]}
    path = write_rows(tmp_path / "p.jsonl", [row] * 4)
    for reward, expected in (("fraction", 0.5), ("all", 0.0)):
        suite = make_suite(EnvSpec(name="code", path=path, num_heldout=1, reward=reward, sandbox=FAST), tok, seed=0)
        b = suite.train_builder("g", 0)
        # Right for 0 and 10 only: passes two tests of four.
        half = step(b, tok, "def inc(x):\n    return x + 1 if x in (0, 10) else x\n```")
        assert half.reward == expected and half.metrics["tests_passed"] == 0.5 and half.metrics["correct"] == 0.0
        full = step(b, tok, "def inc(x):\n    return x + 1\n```")
        assert full.reward == 1.0 and full.metrics["correct"] == 1.0


def test_failure_kinds_are_counted_apart(tmp_path, tok):
    row = {"prompt": "Write `f()`.", "entry_point": "f", "tests": ["assert f() == 1"]}
    suite = make_suite(EnvSpec(name="code", path=write_rows(tmp_path / "p.jsonl", [row] * 4), num_heldout=1,
                               sandbox=FAST), tok, seed=0)
    b = suite.train_builder("g", 0)
    cases = {"code_timeout": "import time\ndef f():\n    time.sleep(60)\n```",
             "code_crash": "def f(:\n```",  # a syntax error
             "code_violation": "x = bytearray(1 << 30)\ndef f():\n    return 1\n```"}
    for kind, program in cases.items():
        r = step(b, tok, program)
        assert r.reward == 0.0 and r.metrics[kind] == 1.0, (kind, r.metrics)
        assert sum(r.metrics[k] for k in cases) == 1.0
    missing = step(b, tok, "def g():\n    return 1\n```")  # no entry point: nothing passes, not a crash
    assert missing.reward == 0.0 and sum(missing.metrics[k] for k in cases) == 0.0


def test_rows_with_malformed_tests_are_counted_and_skipped(tmp_path, tok):
    good = {"prompt": "p", "tests": ["assert 1"]}
    rows = [good, {"prompt": "p"}, {"prompt": "p", "tests": []}, {"prompt": "p", "tests": [1, 2]},
            {"prompt": "p", "tests": ["assert f(("]}, {"prompt": "p", "tests": ["x"], "entry_point": "not valid"},
            "{not json", {"text": "mbpp names", "test_list": json.dumps(["assert 2"])}, good, good]
    with pytest.warns(UserWarning) as warned:
        suite = make_suite(EnvSpec(name="code", path=write_rows(tmp_path / "p.jsonl", rows), num_heldout=1,
                                   sandbox=FAST), tok, seed=0)
    report = suite.data_reports[str(tmp_path / "p.jsonl")]
    assert report.rows == 10 and report.skipped == 6
    text = " ".join(str(w.message) for w in warned)
    for number in (2, 3, 4, 5, 6, 7):
        assert f"row {number}:" in text or f"line {number}:" in text
    assert "test 1 is not valid Python" in text
    assert len(suite.problems) + len(suite.heldout_problems) == 4


def test_the_shipped_problems_and_their_config(tok):
    suite = make_suite(EnvSpec(name="code", num_heldout=200), tok, seed=0)
    assert len(suite.problems) == 36 and len(suite.heldout_problems) == 12  # a quarter held out at most
    assert {p.prompt for p in suite.problems}.isdisjoint(p.prompt for p in suite.heldout_problems)
    assert suite.fence_open and suite.max_tokens >= max(len(tok.encode(p.solution)) for p in suite.problems)
    with pytest.raises(ConfigError, match=r"env.sandbox.cpu_s: expected an integer"):
        load(None, ["env.name=code", "env.sandbox.cpu_s=0"])
    with pytest.raises(ConfigError, match="env.reward"):
        load(None, ["env.name=code", "env.reward='most'"])


def test_untrusted_code_is_refused_without_a_sandbox(tok, monkeypatch):
    from lockstep.sandbox import bwrap

    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap on PATH
    bwrap._probe.cache_clear()
    try:
        with pytest.raises(EnvError, match="bubblewrap .* is not installed.*LOCKSTEP_SANDBOX_UNSAFE"):
            make_suite(EnvSpec(name="code"), tok, seed=0)
    finally:
        bwrap._probe.cache_clear()
