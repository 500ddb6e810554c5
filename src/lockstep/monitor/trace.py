"""Spans, and their export as Chrome/Perfetto trace-event JSON.

A run appends one span per line to RUN_DIR/trace.jsonl as it goes ({"name", "track", "start",
"end", "args"}, wall-clock seconds): rollout batches (generator), their rewards (environments),
train steps (trainer), weight publications and evaluations. `lockstep trace RUN_DIR -o run.json`
turns them into complete ("X") events that chrome://tracing and ui.perfetto.dev open, one named
track per component; spans of one component that overlap (several rollout batches in flight) go
on numbered lanes of it, since a track's complete events must nest. The service's request spans
(queued, running) use the same export.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class SpanLog:
    """Appends spans to a JSON-lines file, each flushed at once (a crash loses none)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "a", buffering=1)
        self._lock = threading.Lock()

    def span(self, name: str, track: str, start: float, end: float, **args) -> None:
        line = json.dumps({"name": name, "track": track, "start": start, "end": max(end, start), "args": args})
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        self._file.close()


class Timed:
    """`with Timed(log, name, track, **args):` records the block as a span (no-op for log None)."""

    def __init__(self, log: SpanLog | None, name: str, track: str, **args):
        self.log, self.name, self.track, self.args = log, name, track, args

    def __enter__(self):
        self.start = time.time()
        return self

    def __exit__(self, *exc):
        if self.log is not None:
            self.log.span(self.name, self.track, self.start, time.time(), **self.args)


def read_spans(path: Path) -> list[dict]:
    """The complete spans of a trace.jsonl (a partial last line, being written, is left out)."""
    spans = []
    for line in Path(path).read_bytes().split(b"\n")[:-1]:
        try:
            s = json.loads(line)
        except ValueError:
            continue
        if isinstance(s, dict) and {"name", "track", "start", "end"} <= s.keys():
            spans.append(s)
    return spans


def chrome_trace(spans: list[dict], process: str) -> dict:
    """Trace-event JSON (the "JSON Object Format"): one process, a thread per track (and lane)."""
    origin = min((s["start"] for s in spans), default=0.0)
    lanes: dict[tuple[str, int], float] = {}  # (track, lane) -> end of its last span
    tids: dict[tuple[str, int], int] = {}
    events = []
    for s in sorted(spans, key=lambda s: (s["start"], s["end"])):
        lane = 0
        while lanes.get((s["track"], lane), float("-inf")) > s["start"]:
            lane += 1
        key = (s["track"], lane)
        lanes[key] = s["end"]
        tid = tids.setdefault(key, len(tids) + 1)
        events.append({"name": s["name"], "cat": s["track"], "ph": "X", "pid": 1, "tid": tid,
                       "ts": round((s["start"] - origin) * 1e6, 3), "dur": round(max(s["end"] - s["start"], 0.0) * 1e6, 3),
                       "args": s.get("args") or {}})
    meta = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": process}}]
    for (track, lane), tid in tids.items():
        meta.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                     "args": {"name": track if lane == 0 else f"{track} #{lane + 1}"}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"origin_unix_s": origin, "spans": len(events)}}
