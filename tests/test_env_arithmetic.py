"""The arithmetic suite, data files as rows, and the suite registry."""

import json

import pytest
from transformers import AutoTokenizer

from lockstep.config.types import EnvSpec
from lockstep.envs.registry import make_suite
from lockstep.envs.rows import read_rows
from lockstep.envs.types import EnvError


@pytest.fixture(scope="module")
def tok(builtin_dir):
    return AutoTokenizer.from_pretrained(builtin_dir)


def test_batches_are_pure_functions_of_the_index_and_skip_heldout(tok):
    suite = make_suite(EnvSpec(num_heldout=50, digits=1), tok, seed=0)
    batches = suite.train(8)
    assert [b.problem for b in batches.get_batch(3)] == [b.problem for b in batches.get_batch(3)]
    assert [b.group_id for b in batches.get_batch(3)] == [f"arith-3-{i}" for i in range(8)]
    held = {b.problem for b in suite.heldout()}
    assert len(suite.heldout()) == 50
    assert not held & {b.problem for i in range(20) for b in batches.get_batch(i)}
    example = suite.sft(4).get_batch(0)[0]
    assert example.completion[-1] == tok.eos_token_id
    assert tok.decode(list(example.prompt + example.completion[:-1])).count("=") == 1


def test_sft_from_a_file_counts_and_skips_rows_missing_fields(tmp_path, tok):
    path = tmp_path / "sft.jsonl"
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2="}, {"completion": "5"}, {"prompt": "3+3=", "answer": "6"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    suite = make_suite(EnvSpec(), tok, seed=0)
    with pytest.warns(UserWarning, match="row 2: missing field 'completion/answer'"):
        data = suite.sft(2, str(path))
    assert vars(suite.data_reports[str(path)]) == {"rows": 5, "skipped": 3}
    texts = sorted(tok.decode(list(e.prompt + e.completion[:-1])) for e in data.get_batch(0))
    assert texts == ["1+1=2", "3+3=6"]


def test_read_rows_refuses_missing_files_and_empty_data(tmp_path):
    with pytest.raises(EnvError, match="does not exist"):
        read_rows(tmp_path / "nope.jsonl", [("prompt",)])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(EnvError, match="expected a .jsonl or .parquet"):
        read_rows(tmp_path / "x.csv", [("prompt",)])
    (tmp_path / "e.jsonl").write_text(json.dumps({"other": 1}) + "\n")
    with pytest.warns(UserWarning), pytest.raises(EnvError, match="no usable rows"):
        read_rows(tmp_path / "e.jsonl", [("prompt",)])


def test_a_user_suite_is_named_module_colon_function(tok):
    suite = make_suite(EnvSpec(name="lockstep.envs.arithmetic:make_suite", digits=2), tok, seed=1)
    assert suite.name == "arithmetic" and suite.task.digits == 2
    with pytest.raises(EnvError, match="cannot import module 'nopkg'"):
        make_suite(EnvSpec(name="nopkg:make"), tok, seed=0)
    with pytest.raises(EnvError, match="has no function 'nothing'"):
        make_suite(EnvSpec(name="lockstep.envs.arithmetic:nothing"), tok, seed=0)


def test_long_addition_works_the_sum_column_by_column_and_grades_the_result(tok):
    """env.name = "long_addition": 7 digits by default, answers of 64+ tokens with a worked scratchpad;
    only the final sum (after the last "|", then EOS) is graded; max_tokens makes room for it."""
    import asyncio

    suite = make_suite(EnvSpec(name="long_addition", num_heldout=20), tok, seed=0)
    assert suite.name == "long_addition" and suite.task.digits == 7 and suite.max_tokens >= 72
    example = suite.sft(4).get_batch(0)[0]
    assert len(example.completion) >= 64 and example.completion[-1] == tok.eos_token_id
    builder = suite.train(2).get_batch(0)[0]
    p = builder.problem
    text = tok.decode(list(example.completion[:-1]))
    assert text.count("|") == 7 and all(len(step) == 8 for step in text.split("|")[:-1])
    a, b = (int(x) for x in tok.decode(list(example.prompt))[:-1].split("+"))
    assert int(text.rpartition("|")[2]) == a + b
    env = builder.make_envs(1, tok)[0]
    eos = (tok.eos_token_id,)

    async def reward(completion: str, end=eos) -> float:
        await env.initial_observation()
        return (await env.step(tuple(tok.encode(completion)) + end)).reward

    assert asyncio.run(reward(p.answer)) == 1.0
    assert asyncio.run(reward("scratch work|" + p.result)) == 1.0  # the working is not graded
    assert asyncio.run(reward(p.answer[:-1] + str((int(p.answer[-1]) + 1) % 10))) == 0.0
    assert asyncio.run(reward(p.answer, end=())) == 0.0  # no EOS
    assert EnvSpec(name="arithmetic").digits == 3 and EnvSpec(name="long_addition", digits=3).digits == 3
