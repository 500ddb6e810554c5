"""`lockstep run` through the whole loop with the agentic envs: the code env (programs graded by
tests in the sandbox) and the python_tool env (multi-turn tool calls, episodes forked from
snapshots), each warmed up on its reference answers, then trained with RL on Ray."""

import json

import pytest
import ray

from lockstep.config import load
from lockstep.runtime.ledger import audit
from lockstep.runtime.run import run

BASE = ["stages.0.batch_size=16", "stages.0.eval_every=100", "stages.0.target_accuracy=0.0",
        "rl.steps=3", "rl.target_accuracy=0.0", "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_every=100", "rl.max_seconds=0",
        "rl.max_staleness=0", "env.pass_k=0", "runtime.checkpoint_every=0"]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    ray.shutdown()


def rl_records(d):
    return [r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "rollout/reward_mean" in r]


def check_exactly_once(d, steps, prompts):
    led = audit(d / "ledger.jsonl")
    assert led.pending() == []
    assert sorted(led.trained_step.values()) == sorted(s for s in range(1, steps + 1) for _ in range(prompts))


def easy_problems(path):
    """Problems a 1M-parameter model can learn in a few dozen steps (the shipped ones take far more),
    so that RL groups have rewards to tell apart; one row is malformed (counted and skipped)."""
    rows = [{"prompt": f"Write `{name}(x)` returning x.", "entry_point": name,
             "tests": [f"assert {name}(1) == 1", f"assert {name}('a') == 'a'", f"assert {name}(None) is None"],
             "solution": f"def {name}(x):\n    return x\n"} for name in ("same", "echo", "keep", "pass_on", "ident", "mirror")]
    rows.append({"prompt": "broken", "tests": "not a list of tests"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trained(rl):
    """RL steps that trained on at least one group (a group whose rewards differ)."""
    return [r for r in rl if r["train/loss_sum"] != 0.0]


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_code_env_runs_through_the_loop(tmp_path, builtin_dir):
    """SFT on reference solutions, then GRPO on programs graded in the sandbox: steps train, the
    tests' share and the failure kinds are in the metrics, logprobs stay exact."""
    data = easy_problems(tmp_path / "easy.jsonl")
    spec = load(None, [*BASE, f"model.path='{builtin_dir}'", "env.name=code", f"env.path='{data}'", "env.num_heldout=1",
                       "stages.0.steps=100", "stages.0.learning_rate=5e-3", "env.sandbox.wall_s=3", "env.sandbox.cpu_s=1"])
    summary = run(spec, tmp_path / "run")
    rl = rl_records(tmp_path / "run")
    assert len(rl) == 3
    for r in rl:
        assert {"env/tests_passed", "env/code_timeout", "env/code_crash", "env/code_violation"} <= r.keys()
        assert 0.0 <= r["env/tests_passed"] <= 1.0 and r["mismatch/abs"] == 0.0
        assert r["env/failed_groups"] == 0  # grading never failed an episode
    # The warm-up taught it to write programs that pass some tests (random bytes pass none).
    assert max(r["env/tests_passed"] for r in rl) > 0.0 and trained(rl)
    assert summary["data"][str(data)] == {"rows": 7, "skipped": 1}
    check_exactly_once(tmp_path / "run", 3, 4)


def easy_tool_problems(path):
    """Questions whose worked answer (a tool call, its output, the answer) is one short transcript,
    learnt in a few dozen steps by the built-in model (the procedural ones take far more)."""
    rows = [{"problem": f"Question {i}: what is six times seven?", "answer": "42", "code": "print(6*7)"} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_tool_env_with_forked_episodes_runs_through_the_loop(tmp_path, builtin_dir):
    """Multi-turn tool calls into the sandboxed interpreter, each episode forked after its first
    turn into two branches: the branches are trained (per-turn advantages), tool output tokens
    carry no loss, and every sampled token's logprob is recomputed exactly."""
    data = easy_tool_problems(tmp_path / "tool.jsonl")
    spec = load(None, [*BASE, f"model.path='{builtin_dir}'", "env.name=python_tool", "env.num_heldout=2",
                       f"env.path='{data}'", "env.max_turns=3", "stages.0.steps=50", "stages.0.learning_rate=3e-3",
                       "rollout.fork.turn=1", "rollout.fork.branches=2", "env.sandbox.wall_s=3", "env.sandbox.cpu_s=1"])
    run(spec, tmp_path / "run")
    rl = rl_records(tmp_path / "run")
    assert len(rl) == 3
    for r in rl:
        assert r["mismatch/abs"] == 0.0 and r["env/failed_groups"] == 0
        assert "env/tool_calls" in r and r["env/tool_replay_mismatch"] == 0.0
    # The warm-up taught the tool call; episodes that made one went on and were forked.
    assert max(r["env/tool_calls"] for r in rl) > 0.0 and max(r["rollout/accuracy"] for r in rl) > 0.0
    assert max(r.get("rollout/forked_share", 0.0) for r in rl) > 0.0 and trained(rl)
    check_exactly_once(tmp_path / "run", 3, 4)
