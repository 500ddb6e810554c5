"""A job reads data files as a stream within a budget of decoded bytes (envs/datafile.py, used by
envs/rows.py): a file that decodes past the budget is refused having held about the budget, never
what the file decodes to, and no line or row shape makes the reader crash or hoard memory."""

import json
import sys
import tracemalloc
import warnings

import pytest
from data_bombs import parquet_bomb

from lockstep.envs.datafile import (BUDGET_ENV, DEFAULT_BUDGET_BYTES, MAX_LINE_BYTES, DataBudgetExceeded,
                                    budget_from_env, decoded_bytes, iter_rows)
from lockstep.envs.rows import read_rows, sft_from_file
from lockstep.envs.types import EnvError

MiB = 1 << 20
SFT_FIELDS = [("prompt",), ("completion",)]


def traced_peak(fn) -> int:
    """Peak bytes Python allocated while `fn` ran (it is expected to raise)."""
    tracemalloc.start()
    try:
        fn()
    except Exception:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("arrow_schema", [True, False], ids=["dictionary-array", "plain-strings"])
def test_a_parquet_bomb_stops_at_the_budget_without_decoding_the_file(tmp_path, arrow_schema):
    path = tmp_path / "bomb.parquet"
    path.write_bytes(parquet_bomb(2_000, 100_000, arrow_schema=arrow_schema, columns=("prompt", "completion")))
    assert path.stat().st_size < 2048  # decodes to 2,000 rows x 2 x 100 KB = 400 MB
    budget = 8 * MiB
    with pytest.raises(DataBudgetExceeded, match=f"more than {budget} bytes .*set {BUDGET_ENV} to raise it") as e:
        read_rows(path, SFT_FIELDS, budget_bytes=budget)
    assert e.value.rows <= budget // 200_000 + 1  # stopped at the row that crossed it, of 2,000
    peak = traced_peak(lambda: read_rows(path, SFT_FIELDS, budget_bytes=budget))
    assert peak < 32 * MiB, peak  # 12.8 MB: the budget and one 64-row batch; the whole file: 401 MB


def test_a_jsonl_file_is_read_line_by_line_within_the_budget(tmp_path):
    path = tmp_path / "big.jsonl"
    line = json.dumps({"prompt": "x" * 50_000, "completion": "y"}) + "\n"
    path.write_text(line * 400)  # 20 MB
    budget = 2 * MiB
    with pytest.raises(DataBudgetExceeded, match=f"more than {budget} bytes"):
        read_rows(path, SFT_FIELDS, budget_bytes=budget)
    assert traced_peak(lambda: read_rows(path, SFT_FIELDS, budget_bytes=budget)) < 6 * MiB  # 2.2 MB; read_text: 40 MB


def test_the_count_is_of_python_objects_so_small_json_cannot_expand_unseen(tmp_path):
    """`[{},{},...]`: 3 bytes of text per dict, sys.getsizeof({}) = 64 in memory."""
    path = tmp_path / "dicts.jsonl"
    path.write_text(json.dumps({"prompt": [{}] * 100_000}) + "\n")  # 400 KB of text
    assert 100_000 * sys.getsizeof({}) > 4 * MiB
    with pytest.raises(DataBudgetExceeded, match=f"more than {4 * MiB} bytes"):
        list(iter_rows(path, budget_bytes=4 * MiB))
    s = "x" * 1000
    assert decoded_bytes({"a": s}) == sys.getsizeof({"a": s}) + sys.getsizeof("a") + sys.getsizeof(s)
    assert decoded_bytes([s, s]) == sys.getsizeof([s, s]) + 2 * sys.getsizeof(s)  # a dictionary value, per row
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert decoded_bytes(deep) == 100_000 * sys.getsizeof([[]]) + sys.getsizeof([])  # no recursion limit


def test_the_scheduler_sets_the_budget_through_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "bomb.parquet"
    path.write_bytes(parquet_bomb(2_000, 100_000, columns=("prompt", "completion")))
    monkeypatch.setenv(BUDGET_ENV, str(4 * MiB))
    assert budget_from_env() == 4 * MiB
    with pytest.raises(DataBudgetExceeded, match=f"more than {4 * MiB} bytes"):
        sft_from_file(path, None, batch_size=1, seed=0)  # refused before any row is tokenized
    monkeypatch.delenv(BUDGET_ENV)
    assert budget_from_env() == DEFAULT_BUDGET_BYTES == 1 << 30  # `lockstep run`: 1 GiB
    for bad in ("0", "-5", "1e9", "lots"):
        monkeypatch.setenv(BUDGET_ENV, bad)
        with pytest.raises(EnvError, match=f"{BUDGET_ENV}=.*expected a positive whole number of bytes"):
            read_rows(path, SFT_FIELDS)


def test_a_line_over_the_cap_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "long.jsonl"
    with open(path, "w") as f:
        f.write('{"prompt": "a", "completion": "b"}\n')
        f.write('{"prompt": "' + "x" * MAX_LINE_BYTES + '"}\n')
    with pytest.raises(EnvError, match=f"line 2 is longer than {MAX_LINE_BYTES} bytes"):
        read_rows(path, SFT_FIELDS)


def test_unreadable_lines_are_skipped_and_unreadable_files_refused(tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = json.dumps({"prompt": "a", "completion": "b"}).encode() + b"\n"
    path.write_bytes(good + b"\xff\xfe{}\n" + b"[" * 100_000 + b"]" * 100_000 + b"\n" + b"[1]\n" + good)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        rows, report = read_rows(path, SFT_FIELDS)
    assert rows == [{"prompt": "a", "completion": "b"}] * 2 and (report.rows, report.skipped) == (5, 3)
    messages = [str(w.message) for w in record]
    assert len(messages) == 3 and "line 2: not UTF-8 text; skipped" in messages[0], messages
    assert "line 3: invalid JSON (nested too deeply)" in messages[1] and "line 4: expected a JSON object" in messages[2]
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really a parquet file PAR1")
    with pytest.raises(EnvError, match="not a readable parquet file"):
        read_rows(bad, SFT_FIELDS)


def test_skipped_rows_keep_ten_messages_not_one_per_row(tmp_path):
    path = tmp_path / "junk.jsonl"
    path.write_text("x\n" * 20_000)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        peak = traced_peak(lambda: read_rows(path, SFT_FIELDS))
    assert len(record) == 11 and "19990 more rows skipped" in str(record[-1].message)
    assert peak < MiB, peak  # keeping a message and an EnvError per row: 8.7 MB
