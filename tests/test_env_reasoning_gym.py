"""The `reasoning_gym` suite: task lookup, held-out split, answer extraction, the task's scorer."""

from __future__ import annotations

import asyncio
import pickle

import pytest
from transformers import AutoTokenizer

from lockstep.config.types import EnvSpec
from lockstep.envs import reasoning_gym as rg_env
from lockstep.envs.registry import make_suite
from lockstep.envs.types import EnvError, SFTExample


@pytest.fixture(scope="module")
def tok(builtin_dir):
    return AutoTokenizer.from_pretrained(builtin_dir)


def suite_for(tok, task="basic_arithmetic", *, size=50, num_heldout=5, seed=0, **kw):
    spec = EnvSpec(name="reasoning_gym", task=task, size=size, num_heldout=num_heldout, **kw)
    return make_suite(spec, tok, seed=seed)


def score(builder, text, tok):
    """(reward, metrics) of one episode answering `text` then EOS, through the async env."""
    async def run():
        env = builder.make_envs(1, tok)[0]
        await env.initial_observation()
        result = await env.step(tok.encode(text) + [tok.eos_token_id])
        assert result.episode_done
        return result.reward, result.metrics

    return asyncio.run(run())


def test_scores_with_the_tasks_own_scorer(tok):
    suite = suite_for(tok)
    builder = suite.train(4).get_batch(0)[0]
    question, answer = builder.entry["question"], builder.entry["answer"]
    assert isinstance(answer, str) and answer

    obs = asyncio.run(builder.make_envs(1, tok)[0].initial_observation())
    assert obs.tokens == tuple(tok.encode(question + "\nAnswer: "))
    assert obs.max_tokens == EnvSpec().max_tokens

    assert score(builder, answer, tok) == (1.0, {"correct": 1.0})
    assert score(builder, f"<think>hmm</think> <answer> {answer} </answer>", tok) == (1.0, {"correct": 1.0})
    assert score(builder, "x", tok) == (0.0, {"correct": 0.0})
    # basic_arithmetic uses the default scorer: the oracle inside a longer answer earns
    # len(oracle) / len(answer), which is not correct.
    assert score(builder, answer + " ab", tok) == (len(answer) / (len(answer) + 3), {"correct": 0.0})


def test_extract_answer():
    assert rg_env.extract_answer("so <answer>1</answer> no, <answer> 12 </answer>\n") == "12"
    assert rg_env.extract_answer("  12 \n") == "12"
    assert rg_env.extract_answer("<answer>12") == "<answer>12"


def test_builders_pickle_and_score_in_a_fresh_process(tok, monkeypatch):
    builder = suite_for(tok).heldout()[2]
    copy = pickle.loads(pickle.dumps(builder))
    assert copy == builder and copy.group_id == "heldout-2" and copy.index == 2
    # An env worker has no suite: it rebuilds the dataset from the builder's reference.
    monkeypatch.setattr(rg_env, "_DATASETS", {})
    assert score(copy, copy.entry["answer"], tok)[0] == 1.0
    assert set(rg_env._DATASETS) == {copy.ref}


def test_heldout_never_trains_and_batches_are_deterministic(tok):
    suite = suite_for(tok, "coin_flip", size=100, num_heldout=20)
    heldout = {b.entry["question"] for b in suite.heldout()}
    # This task repeats questions across seeds, so the split has real collisions to avoid.
    assert any(suite.train_data[i]["question"] in heldout for i in range(100))
    train = suite.train(10)
    assert len(train) == 10
    batches = [train.get_batch(i) for i in range(12)]
    assert all(b.entry["question"] not in heldout for batch in batches for b in batch)
    assert len({b.group_id for batch in batches for b in batch}) == 120
    assert batches[11] == suite_for(tok, "coin_flip", size=100, num_heldout=20).train(10).get_batch(11)
    assert suite.heldout_ref.seed == 100 and suite.train_ref.seed == 0


def test_unknown_task_suggests_names(tok):
    with pytest.raises(EnvError, match="did you mean 'basic_arithmetic'"):
        suite_for(tok, "basic_arithmetc")
    with pytest.raises(EnvError, match="did you mean 'basic_arithmetic' or 'decimal_arithmetic'"):
        suite_for(tok, "arithmetic")
    with pytest.raises(EnvError, match=r"no task 'zzzz'; its \d+ tasks include ab, acre, "):
        suite_for(tok, "zzzz")


def test_sft_examples(tok):
    suite = suite_for(tok)
    eos = tok.eos_token_id
    examples = suite.sft(3).get_batch(0)
    entries = [b.entry for b in suite.train(3).get_batch(0)]
    assert examples == [SFTExample(tuple(tok.encode(e["question"] + "\nAnswer: ")),
                                   tuple(tok.encode(e["answer"])) + (eos,)) for e in entries]
    with pytest.raises(EnvError, match="no reference answers"):
        suite_for(tok, "propositional_logic", size=5, num_heldout=2).sft(2)
