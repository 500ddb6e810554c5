"""A run's step metrics for Prometheus (`lockstep run --metrics-port P`).

The exporter reads the run's own record, metrics.jsonl, at each scrape (only what was appended
since the last one), so it needs nothing from the processes that write it, and serves the latest
value of every numeric key as a gauge: `rollout/reward_mean` -> `lockstep_run_rollout_reward_mean`,
a trailing `_s` (seconds) spelled `_seconds` as Prometheus' conventions ask. The file may be read
while it is written: a partial last line waits for the next scrape.
"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lockstep.monitor.runfile import MetricsFile

PREFIX = "lockstep_run_"


def metric_name(key: str) -> str:
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_").lower()
    name = re.sub(r"_s$", "_seconds", name)
    return PREFIX + re.sub(r"_+", "_", name)


class RunCollector:
    def __init__(self, run_dir: Path):
        self.file = MetricsFile(Path(run_dir) / "metrics.jsonl")

    def collect(self):
        self.file.refresh()
        yield GaugeMetricFamily(PREFIX + "step", "The run's latest global step", value=self.file.step)
        yield CounterMetricFamily(PREFIX + "records", "Step records written to metrics.jsonl", value=self.file.records)
        names: dict[str, str] = {}
        for key, value in sorted(self.file.latest.items()):
            name = metric_name(key)
            if name in names or name in (PREFIX + "step", PREFIX + "records"):
                continue  # two keys that spell the same name: the first one wins
            names[name] = key
            yield GaugeMetricFamily(name, f"Latest value of {key} in metrics.jsonl", value=value)


def serve_run_metrics(run_dir: Path, port: int, host: str = "127.0.0.1"):
    """Serve the run's metrics at http://host:port/metrics from a daemon thread; returns the server."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(run_dir))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
