"""Data files as rows: jsonl or parquet, with rows missing a field counted and skipped.

Shared by the `math` suite and by supervised warm-up from a file. Batches are drawn from a
per-epoch shuffle keyed by (seed, epoch), so `get_batch(i)` is a pure function of `i`.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Callable, Sequence

from lockstep.envs.types import DataReport, EnvError, SFTExample

MAX_WARNINGS = 10
"""Skipped rows warned about one by one; the rest are summarised in one line."""


def _parse_line(number: int, line: str) -> dict | EnvError:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return EnvError(f"line {number}: invalid JSON ({e.msg}); skipped")
    return row if isinstance(row, dict) else EnvError(f"line {number}: expected a JSON object; skipped")


def _read_raw(path: Path) -> list:
    """Rows of a file in order; an unreadable jsonl line becomes an EnvError in its place."""
    if path.suffix == ".jsonl":
        lines = path.read_text().splitlines()
        return [_parse_line(i, line) for i, line in enumerate(lines, start=1) if line.strip()]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise EnvError(f"{path}: expected a .jsonl or .parquet file")


def read_rows(path: str | Path, fields: Sequence[Sequence[str]], *, optional: Sequence[str] = (),
              check: Callable[[dict], str] | None = None) -> tuple[list[dict], DataReport]:
    """Rows of `path` holding every field; each entry of `fields` lists accepted names for one
    field (the first present wins), and the returned rows use the first name as the key. Fields
    named in `optional` are kept when present. `check(row)` returns why a row is unusable ('' if
    it is fine).

    Rows with a missing or empty field, or that `check` rejects, are skipped with a warning naming
    the row (1-based).
    """
    path = Path(path)
    if not path.is_file():
        raise EnvError(f"data file {str(path)!r} does not exist")
    raw, rows, skipped = _read_raw(path), [], []
    for number, row in enumerate(raw, start=1):
        if isinstance(row, EnvError):
            skipped.append(f"{path}: {row}")
            continue
        out, missing = {}, None
        for names in fields:
            value = next((row[n] for n in names if n in row and row[n] not in (None, "")), None)
            if value is None:
                missing = "/".join(names)
                break
            out[names[0]] = value
        if missing is not None:
            skipped.append(f"{path}: row {number}: missing field {missing!r}; skipped")
            continue
        out.update({name: row[name] for name in optional if row.get(name) not in (None, "")})
        problem = check(out) if check else ""
        if problem:
            skipped.append(f"{path}: row {number}: {problem}; skipped")
        else:
            rows.append(out)
    for message in skipped[:MAX_WARNINGS]:
        warnings.warn(message, stacklevel=2)
    if len(skipped) > MAX_WARNINGS:
        warnings.warn(f"{path}: {len(skipped) - MAX_WARNINGS} more rows skipped (missing or malformed fields)",
                      stacklevel=2)
    if not rows:
        raise EnvError(f"{path}: no usable rows (need fields {[list(f) for f in fields]}; {len(skipped)} skipped)")
    return rows, DataReport(rows=len(raw), skipped=len(skipped))


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
