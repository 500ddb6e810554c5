"""A data file's rows as a stream, within a budget of decoded bytes.

A data file is jsonl (one JSON object per line) or parquet. Its size says little about what it
decodes to: an 813-byte parquet file of one 100 KB value repeated 20,000 times (a dictionary page
and run-length-encoded indices) decodes to 2 GB, and neither the file's size nor its metadata
(`total_byte_size` counts the dictionary page once) tells. So rows are decoded one jsonl line or
one small parquet batch at a time and their decoded size is counted as they come: the memory the
row takes as Python objects (`decoded_bytes`, a dictionary's value counted at each row that uses
it). Past the budget, reading stops with `DataBudgetExceeded`, having held at most one batch
beyond it.

The service's upload check and a job's readers (`envs/rows.py`) count with this same code, so a
dataset the upload accepted under the operator's `max_dataset_decoded_bytes` fits a job whose
budget the scheduler sets from that cap through $LOCKSTEP_DATA_BUDGET_BYTES.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

from lockstep.envs.types import EnvError

BUDGET_ENV = "LOCKSTEP_DATA_BUDGET_BYTES"
"""Decoded bytes one data file may hold in a job process (the scheduler sets it from the policy)."""
DEFAULT_BUDGET_BYTES = 1 << 30
"""The budget without $LOCKSTEP_DATA_BUDGET_BYTES (`lockstep run` on your own machine)."""
MAX_LINE_BYTES = 16 << 20
"""A jsonl line, newline included: a longer one is refused before it is parsed (parsing can take
~25x a line's size: `[{},{},...]`)."""
BATCH_ROWS = 64
"""Parquet rows decoded at once: 64 rows of a 100 KB value hold 6.4 MB (500k short rows read in
0.42 s at 64 per batch, 0.22 s at 1,024)."""


class DataBudgetExceeded(EnvError):
    """A data file decodes to more than its budget of bytes."""

    def __init__(self, path: str | Path, budget: int, rows: int):
        self.budget, self.rows = budget, rows
        super().__init__(f"{path}: the rows decode to more than {budget} bytes (by row {rows}), over the data "
                         f"budget; set {BUDGET_ENV} to raise it (under the service, the operator's "
                         f"max_dataset_decoded_bytes sets it)")


def budget_from_env() -> int:
    """$LOCKSTEP_DATA_BUDGET_BYTES, or DEFAULT_BUDGET_BYTES when it is unset."""
    raw = os.environ.get(BUDGET_ENV, "").strip()
    if not raw:
        return DEFAULT_BUDGET_BYTES
    if not raw.isdigit() or int(raw) < 1:
        raise EnvError(f"{BUDGET_ENV}={raw[:40]!r}: expected a positive whole number of bytes")
    return int(raw)


def decoded_bytes(value, limit: int = sys.maxsize) -> int:
    """Memory `value` takes as Python objects: sys.getsizeof of it and of everything it holds, an
    object held twice counted twice (as a parquet dictionary is expanded into every row). Stops
    counting once past `limit`. Iterative: a row may nest as deep as json allows."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        total += sys.getsizeof(v)
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


def iter_rows(path: str | Path, *, budget_bytes: int, fmt: str = "") -> Iterator[dict | EnvError]:
    """Rows of a jsonl or parquet file (`fmt`, else the file's suffix) in order; a jsonl line that is
    not a JSON object comes as an EnvError in its place ("line N: ..."). Raises DataBudgetExceeded
    once the rows read so far decode to more than `budget_bytes`, EnvError for an unreadable file or
    a line over MAX_LINE_BYTES."""
    path = Path(path)
    fmt = fmt or path.suffix.lstrip(".")
    spent, rows = 0, 0

    def spend(num_bytes: int) -> None:
        nonlocal spent, rows
        spent, rows = spent + num_bytes, rows + 1
        if spent > budget_bytes:
            raise DataBudgetExceeded(path, budget_bytes, rows)

    if fmt == "jsonl":
        yield from _jsonl(path, spend, budget_bytes)
    elif fmt == "parquet":
        yield from _parquet(path, spend, budget_bytes)
    else:
        raise EnvError(f"{path}: expected a .jsonl or .parquet file")


def _jsonl(path: Path, spend: Callable[[int], None], budget: int) -> Iterator[dict | EnvError]:
    with open(path, "rb") as f:
        for number in itertools.count(1):
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            if len(raw) > MAX_LINE_BYTES:
                raise EnvError(f"{path}: line {number} is longer than {MAX_LINE_BYTES} bytes (MAX_LINE_BYTES); "
                               f"one row per line, each shorter")
            if not raw.strip():
                continue
            row = _parse_line(number, raw)
            spend(len(raw) if isinstance(row, EnvError) else decoded_bytes(row, budget))
            yield row if isinstance(row, (dict, EnvError)) else EnvError(
                f"line {number}: expected a JSON object, got {type(row).__name__}")


def _parse_line(number: int, raw: bytes):
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return EnvError(f"line {number}: not UTF-8 text")
    except json.JSONDecodeError as e:
        return EnvError(f"line {number}: invalid JSON ({e.msg})")
    except RecursionError:
        return EnvError(f"line {number}: invalid JSON (nested too deeply)")


def _parquet(path: Path, spend: Callable[[int], None], budget: int) -> Iterator[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS, use_threads=False)
        for batch in batches:
            for row in batch.to_pylist():  # dictionary columns come out expanded, a str per row
                spend(decoded_bytes(row, budget))
                yield row
    except (EnvError, MemoryError):  # the budget; pa.ArrowMemoryError is the process's bound, not the file
        raise
    except (pa.ArrowException, OSError, ValueError, OverflowError) as e:  # (a value Python cannot hold)
        raise EnvError(f"{path}: not a readable parquet file: {str(e)[:200]}") from None
