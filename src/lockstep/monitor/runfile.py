"""A run's metrics.jsonl read while the run writes it: incrementally (only what was appended since
the last read), up to the last complete line (a partial one waits for the next read), following a
rewrite (a resumed run drops the records past its checkpoint)."""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path


class JsonLines:
    """A JSON-lines file read incrementally: each `new()` returns the objects of the lines completed
    since the last one; `rewrites` counts the times the file was found shorter or replaced
    (rewritten) and read again from its start."""

    def __init__(self, path: Path):
        self.path, self._offset, self.rewrites = Path(path), 0, 0
        self._inode: int | None = None

    def new(self) -> list[dict]:
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return []
        with f:
            st = os.fstat(f.fileno())
            # A rewrite replaces the file (a new inode) and may have grown past our offset since.
            if st.st_size < self._offset or (self._inode is not None and st.st_ino != self._inode):
                self._offset, self.rewrites = 0, self.rewrites + 1
            self._inode = st.st_ino
            f.seek(self._offset)
            chunk = f.read(st.st_size - self._offset)
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a partial last line: the next call
        self._offset += len(complete)
        out = []
        for line in complete.splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue  # not a record (a torn write from a crash)
            if isinstance(obj, dict):
                out.append(obj)
        return out


def ledger_counts(events: list[dict], counts: dict[str, int] | None = None) -> dict[str, int]:
    """Groups issued, generated, rewarded, trained and filtered, from ledger.jsonl's events (added
    to `counts` when given)."""
    counts = counts if counts is not None else {e: 0 for e in LEDGER_EVENTS}
    for e in events:
        if e.get("event") in counts and isinstance(e.get("ids"), list):
            counts[e["event"]] += len(e["ids"])
    return counts


LEDGER_EVENTS = ("issued", "generated", "rewarded", "trained", "filtered")


class MetricsFile:
    """metrics.jsonl read incrementally: the latest value of each key, and the records seen."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lines = JsonLines(self.path)
        self._lock = threading.Lock()
        self.latest: dict[str, float] = {}
        self.step = 0
        self.records = 0

    def refresh(self) -> list[dict]:
        """Read what was appended since the last call; return its records."""
        with self._lock:
            rewrites = self._lines.rewrites
            new = self._lines.new()
            if self._lines.rewrites != rewrites:  # (a resumed run drops the records past its checkpoint)
                self.latest, self.records = {}, 0
            for record in new:
                self._take(record)
            return new

    def _take(self, record: dict) -> None:
        self.records += 1
        self.step = int(record.get("step", self.step))
        for k, v in record.items():
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self.latest[k] = float(v)
