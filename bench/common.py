"""Shared helpers for the benchmarks: model configs by size, timing, machine description."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from lockstep.engine.tiny import ensure_tiny_model, save_model_dir, tiny_config

# (hidden, layers, heads, kv_heads, intermediate) giving ~5M and ~20M parameters with the byte vocab.
SIZES = {
    "5M": dict(hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=768),
    "20M": dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=1536),
    "100M": dict(hidden_size=768, num_layers=14, num_heads=12, num_kv_heads=4, intermediate_size=2560),
}


def model_dir(size: str, root: str | Path = "bench/.models") -> str:
    """The built-in model for "builtin", otherwise a seeded config of that size (cached on disk)."""
    if size == "builtin":
        return str(ensure_tiny_model())
    path = Path(root) / size
    if not (path / "config.json").exists():
        save_model_dir(path, tiny_config(**SIZES[size]), seed=0)
    return str(path)


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def median(xs):
    return statistics.median(xs)


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "date": date.today().isoformat()}


def emit(name: str, rows: list[dict], extra: dict | None = None) -> None:
    """Print a markdown table and a JSON line; also write bench/results/<name>.json."""
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    payload = {"bench": name, "machine": machine(), "rows": rows, **(extra or {})}
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path(f"bench/results/{name}.json").write_text(json.dumps(payload, indent=2))
    print(json.dumps(payload))
