"""Metric sinks: metrics.jsonl always, TensorBoard when installed. One logger fronts both."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


class MetricsLogger:
    """Writes one JSON object per step (keys `area/name`), flushed at once so a crash loses nothing."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except Exception:  # noqa: BLE001 - TensorBoard is optional; jsonl is the record
                self._tb = None
        self.records: list[dict] = []

    def log(self, step: int, record: dict) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in record.items()}
        clean = {"step": step, "time": time.time(), **clean}
        self._file.write(json.dumps(clean) + "\n")
        self.records.append(clean)
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
