"""Data files as rows: jsonl or parquet, with rows missing a field counted and skipped.

Shared by the `math` suite and by supervised warm-up from a file. Batches are drawn from a
per-epoch shuffle keyed by (seed, epoch), so `get_batch(i)` is a pure function of `i`.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Callable, Sequence

from lockstep.envs.datafile import budget_from_env, iter_rows
from lockstep.envs.types import DataReport, EnvError, SFTExample

MAX_WARNINGS = 10
"""Skipped rows warned about one by one; the rest are summarised in one line."""


def read_rows(path: str | Path, fields: Sequence[Sequence[str]], *, optional: Sequence[str] = (),
              check: Callable[[dict], str] | None = None,
              budget_bytes: int | None = None) -> tuple[list[dict], DataReport]:
    """Rows of `path` holding every field; each entry of `fields` lists accepted names for one
    field (the first present wins), and the returned rows use the first name as the key. Fields
    named in `optional` are kept when present. `check(row)` returns why a row is unusable ('' if
    it is fine).

    Rows with a missing or empty field, or that `check` rejects, are skipped with a warning naming
    the row (1-based). The file is read as a stream: past `budget_bytes` of decoded rows (default:
    $LOCKSTEP_DATA_BUDGET_BYTES, else 1 GiB) it stops with DataBudgetExceeded.
    """
    path = Path(path)
    if not path.is_file():
        raise EnvError(f"data file {str(path)!r} does not exist")
    budget = budget_from_env() if budget_bytes is None else budget_bytes
    rows, warned, num_read, num_skipped = [], [], 0, 0
    for number, row in enumerate(iter_rows(path, budget_bytes=budget), start=1):
        num_read += 1
        out, problem = _usable(number, row, fields, optional, check)
        if out is not None:
            rows.append(out)
            continue
        num_skipped += 1
        if len(warned) < MAX_WARNINGS:  # only these are kept: a file may skip millions of rows
            warned.append(f"{path}: {problem}; skipped")
    for message in warned:
        warnings.warn(message, stacklevel=2)
    if num_skipped > MAX_WARNINGS:
        warnings.warn(f"{path}: {num_skipped - MAX_WARNINGS} more rows skipped (missing or malformed fields)",
                      stacklevel=2)
    if not rows:
        raise EnvError(f"{path}: no usable rows (need fields {[list(f) for f in fields]}; {num_skipped} skipped)")
    return rows, DataReport(rows=num_read, skipped=num_skipped)


def _usable(number: int, row: dict | EnvError, fields: Sequence[Sequence[str]], optional: Sequence[str],
            check: Callable[[dict], str] | None) -> tuple[dict | None, str]:
    """(the row's fields under their first names, '') or (None, why it is skipped)."""
    if isinstance(row, EnvError):
        return None, str(row)
    out = {}
    for names in fields:
        value = next((row[n] for n in names if n in row and row[n] not in (None, "")), None)
        if value is None:
            return None, f"row {number}: missing field {'/'.join(names)!r}"
        out[names[0]] = value
    out.update({name: row[name] for name in optional if row.get(name) not in (None, "")})
    problem = check(out) if check else ""
    return (None, f"row {number}: {problem}") if problem else (out, "")


class EpochBatches:
    """Deterministic batches over `n` items: epoch e is a shuffle seeded by (seed, e)."""

    def __init__(self, n: int, batch_size: int, seed: int):
        if n < 1:
            raise EnvError("a dataset needs at least one row")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.n))
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch cached: batches are read in order
        return self._orders[epoch]

    def indices(self, index: int) -> list[int]:
        """Row indices of batch `index` (batches may straddle an epoch boundary)."""
        start = index * self.batch_size
        return [self._order(k // self.n)[k % self.n] for k in range(start, start + self.batch_size)]

    def __len__(self) -> int:
        return max(1, self.n // self.batch_size)


class FileSFTDataset:
    """Supervised examples from rows of `prompt` and `completion` (EOS is appended)."""

    def __init__(self, examples: list[SFTExample], batch_size: int, seed: int):
        self.examples = examples
        self.batches = EpochBatches(len(examples), batch_size, seed)

    def get_batch(self, index: int) -> list[SFTExample]:
        return [self.examples[i] for i in self.batches.indices(index)]

    def __len__(self) -> int:
        return len(self.batches)


def sft_from_file(path: str | Path, tokenizer, *, batch_size: int, seed: int,
                  render_prompt: Callable[[str], Sequence[int]] | None = None) -> tuple[FileSFTDataset, DataReport]:
    """A supervised dataset from a jsonl/parquet file of `prompt` / `completion` rows.

    `render_prompt` turns the prompt text into tokens (a suite's template); plain encoding otherwise.
    """
    rows, report = read_rows(path, [("prompt",), ("completion", "answer")])
    encode = render_prompt or (lambda text: tokenizer.encode(text))
    eos = tokenizer.eos_token_id
    examples = [SFTExample(tuple(encode(str(r["prompt"]))), tuple(tokenizer.encode(str(r["completion"]))) + (eos,))
                for r in rows]
    return FileSFTDataset(examples, batch_size, seed), report
