"""Metric sinks: metrics.jsonl always, TensorBoard when installed. One logger fronts both."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


def _keep_through(path: Path, step: int) -> None:
    """Drop records after `step` (a resumed run replays them), by an atomic rewrite."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class MetricsLogger:
    """Writes one JSON object per step (keys `area/name`), flushed at once so a crash loses nothing.

    `keep_through`: a resumed run first drops records past its checkpoint's step (metrics are keyed
    by step, so the replayed steps overwrite rather than duplicate; TensorBoard purges likewise).
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, keep_through: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if keep_through is not None:
            _keep_through(self.path, keep_through)
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                purge = None if keep_through is None else keep_through + 1
                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=purge)
            except Exception:  # noqa: BLE001 - TensorBoard is optional; jsonl is the record
                self._tb = None

    def log(self, step: int, record: dict) -> None:
        record = {k: v for k, v in record.items() if v is not None}
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in record.items()}
        self._file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
