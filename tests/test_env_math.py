"""The `math` suite: data files, held-out split, prompts, and math-verify grading in the pool."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading

import pytest
from transformers import AutoTokenizer

from lockstep.config.types import EnvSpec
from lockstep.envs import math as math_env
from lockstep.envs.registry import make_suite
from lockstep.envs.types import DataReport, EnvError, SFTExample

TEMPLATE = "{question}\nAnswer: "


@pytest.fixture(scope="module")
def tok(builtin_dir):
    return AutoTokenizer.from_pretrained(builtin_dir)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def numbered_rows(count):
    return [{"problem": f"q{k}", "answer": str(k)} for k in range(count)]


def suite_for(tok, path, **kw):
    kw.setdefault("num_heldout", 3)
    return make_suite(EnvSpec(name="math", path=path, **kw), tok, seed=0)


def score(builder, text, tok):
    """(reward, metrics, done) of one episode answering `text` then EOS, through the async env."""
    async def run():
        env = builder.make_envs(1, tok)[0]
        await env.initial_observation()
        result = await env.step(tok.encode(text) + [tok.eos_token_id])
        return result.reward, result.metrics, result.episode_done

    return asyncio.run(run())


def test_grading_through_the_env_and_pool(tok, tmp_path):
    rows = [{"problem": "What is 1/2 as a decimal?", "answer": "0.5"},
            {"question": "What is 6*7?", "answer": "42"},
            {"problem": "What is 3+4?", "solution": "3+4 makes $7$, so the answer is $\\boxed{7}$."}]
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(4))
    suite = suite_for(tok, path, test_path=write_jsonl(tmp_path / "test.jsonl", rows))
    half, forty_two, seven = suite.heldout()
    assert [b.group_id for b in suite.heldout()] == ["heldout-0", "heldout-1", "heldout-2"]

    obs = asyncio.run(forty_two.make_envs(1, tok)[0].initial_observation())
    assert obs.tokens == tuple(tok.encode("What is 6*7?\nAnswer: "))
    assert len(obs.tokens) == len("What is 6*7?\nAnswer: ")  # byte-level: one token per ASCII char
    assert obs.stop is None and obs.max_tokens == EnvSpec().max_tokens

    assert score(half, "$\\frac{1}{2}$", tok) == (1.0, {"correct": 1.0}, True)
    assert score(half, "0.25", tok) == (0.0, {"correct": 0.0}, True)
    assert score(forty_two, "42", tok) == (1.0, {"correct": 1.0}, True)
    assert score(forty_two, "41", tok) == (0.0, {"correct": 0.0}, True)
    assert score(seven, "The answer is \\boxed{7}", tok)[0] == 1.0
    assert score(seven, "8", tok)[0] == 0.0


def test_grading_off_the_main_thread(tok, tmp_path):
    # Envs run in Ray async actors, off the main thread, where math-verify's signal.alarm timeouts
    # cannot be set; grading in the pool still works there.
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(4))
    builder = suite_for(tok, path, num_heldout=1).heldout()[0]
    assert run_in_thread(lambda: score(builder, "3", tok)) == (1.0, {"correct": 1.0}, True)
    assert run_in_thread(lambda: score(builder, "4", tok)) == (0.0, {"correct": 0.0}, True)
    with pytest.raises(ValueError, match="threaded environment"):  # why the pool is needed
        run_in_thread(lambda: math_env.grade("3", "3"))


def run_in_thread(fn):
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    worker = threading.Thread(target=target)
    worker.start()
    worker.join(timeout=60)
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_grade_in_process_and_errors_propagate(tok, tmp_path):
    assert math_env.grade("0.5", "$\\frac{1}{2}$") is True
    assert math_env.grade("\\text{Monday}", "no idea") is False
    with pytest.raises(ValueError, match="cannot parse the reference answer"):
        math_env.grade("$$", "1")
    # ...and through the pool the worker's exception reaches the caller (the runtime retries).
    with pytest.raises(ValueError, match="cannot parse the reference answer"):
        asyncio.run(math_env.grade_async("$$", "1"))


def test_missing_fields_are_counted_and_warned(tok, tmp_path):
    rows = numbered_rows(6)
    rows[1] = {"problem": "q1"}
    rows[3] = {"problem": "", "answer": "3"}
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.warns(UserWarning) as record:
        suite = suite_for(tok, path, num_heldout=1)
    messages = [str(w.message) for w in record]
    assert any("row 2: missing field 'answer/solution'" in m for m in messages)
    assert any("row 4: missing field 'problem/question'" in m for m in messages)
    assert suite.data_reports == {path: DataReport(rows=6, skipped=2)}
    assert [p.question for p in suite.problems] == ["q0", "q2", "q4"]
    assert [b.question for b in suite.heldout()] == ["q5"]


def test_heldout_tail_never_trains_and_batches_are_deterministic(tok, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(12))
    suite = suite_for(tok, path)
    assert [b.question for b in suite.heldout()] == ["q9", "q10", "q11"]
    train = suite.train(4)
    assert len(train) == 2  # 9 training rows // 4
    seen, ids = set(), set()
    for i in range(6):  # batches 2..5 straddle epochs
        batch = train.get_batch(i)
        assert len(batch) == 4
        seen |= {b.question for b in batch}
        ids |= {b.group_id for b in batch}
    assert seen == {f"q{k}" for k in range(9)}
    assert len(ids) == 24 and "math-3-1" in ids
    assert train.get_batch(5) == suite_for(tok, path).train(4).get_batch(5)
    b = train.get_batch(0)[0]
    assert b.answer == b.question[1:] and b.prompt == tuple(tok.encode(b.question + "\nAnswer: "))


def test_parquet_matches_jsonl_and_builders_pickle(tok, tmp_path):
    rows = numbered_rows(8)
    from_jsonl = suite_for(tok, write_jsonl(tmp_path / "d.jsonl", rows))
    parquet = write_parquet(tmp_path / "d.parquet", rows)
    from_parquet = suite_for(tok, parquet)
    assert from_parquet.data_reports == {parquet: DataReport(rows=8, skipped=0)}
    assert from_parquet.train(3).get_batch(1) == from_jsonl.train(3).get_batch(1)
    assert from_parquet.heldout() == from_jsonl.heldout()
    builder = from_parquet.heldout()[0]
    copy = pickle.loads(pickle.dumps(builder))
    assert copy == builder and copy.answer == "5"
    assert score(copy, "5", tok)[0] == 1.0


def test_too_few_rows_and_missing_files(tok, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(3))
    with pytest.raises(EnvError, match="num_heldout"):
        suite_for(tok, path, num_heldout=3)
    with pytest.raises(EnvError, match="does not exist"):
        suite_for(tok, str(tmp_path / "nope.jsonl"))
    with pytest.raises(EnvError, match="does not exist"):
        suite_for(tok, path, test_path=str(tmp_path / "nope.parquet"))


def test_heldout_problems_repeated_in_train_are_dropped(tok, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(5))
    test = write_jsonl(tmp_path / "test.jsonl", [{"problem": "q2", "answer": "2"}])
    with pytest.warns(UserWarning, match="1 training rows repeat a held-out problem"):
        suite = suite_for(tok, path, test_path=test)
    assert [p.question for p in suite.problems] == ["q0", "q1", "q3", "q4"]
    assert set(suite.data_reports) == {path, test}


def test_sft_examples(tok, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(5))
    suite = suite_for(tok, path, num_heldout=1)
    eos = tok.eos_token_id
    examples = suite.sft(4).get_batch(0)
    assert len(examples) == 4
    assert {ex.prompt for ex in examples} == {tuple(tok.encode(f"q{k}\nAnswer: ")) for k in range(4)}
    assert SFTExample(tuple(tok.encode("q3\nAnswer: ")), (tok.encode("3")[0], eos)) in examples

    sft_path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "hi", "completion": "yo"}, {"prompt": "x"}])
    with pytest.warns(UserWarning, match="row 2"):
        dataset = suite.sft(1, path=sft_path)
    assert dataset.get_batch(0) == [SFTExample(tuple(tok.encode("hi\nAnswer: ")), tuple(tok.encode("yo")) + (eos,))]
    assert suite.data_reports[sft_path] == DataReport(rows=2, skipped=1)


def test_chat_template_and_bad_templates(tok, builtin_dir, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", numbered_rows(4))
    with pytest.raises(EnvError, match="no chat template"):
        suite_for(tok, path, chat_template=True)
    with pytest.raises(EnvError, match="prompt_template"):
        suite_for(tok, path, prompt_template="{question} in \\boxed{}")

    chat_tok = AutoTokenizer.from_pretrained(builtin_dir)
    chat_tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                              "{% if add_generation_prompt %}<assistant>{% endif %}")
    suite = suite_for(chat_tok, path, chat_template=True, prompt_template="Q: {question}")
    assert suite.heldout()[0].prompt == tuple(chat_tok.encode("<user>Q: q1<assistant>"))
    assert all(isinstance(t, int) for t in suite.heldout()[0].prompt)
