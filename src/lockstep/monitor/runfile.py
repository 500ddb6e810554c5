"""A run's metrics.jsonl read while the run writes it: incrementally (only what was appended since
the last read), up to the last complete line (a partial one waits for the next read), following a
rewrite (a resumed run drops the records past its checkpoint)."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path


class MetricsFile:
    """metrics.jsonl read incrementally: the latest value of each key, and the records seen."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._offset = 0
        self._lock = threading.Lock()
        self.latest: dict[str, float] = {}
        self.step = 0
        self.records = 0

    def refresh(self) -> list[dict]:
        """Read what was appended since the last call; return its records."""
        with self._lock:
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                return []
            if size < self._offset:  # rewritten (a resumed run drops the records past its checkpoint)
                self._offset, self.latest, self.records = 0, {}, 0
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(size - self._offset)
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a partial last line: the next call
            self._offset += len(complete)
            return [r for r in map(self._take, complete.splitlines()) if r is not None]

    def _take(self, line: bytes) -> dict | None:
        try:
            record = json.loads(line)
        except ValueError:
            return None  # not a record (a torn write from a crash)
        if not isinstance(record, dict):
            return None
        self.records += 1
        self.step = int(record.get("step", self.step))
        for k, v in record.items():
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self.latest[k] = float(v)
        return record
