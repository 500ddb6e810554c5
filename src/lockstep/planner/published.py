"""Published training runs as planner inputs, and the step time each one reports.

tests/data/planner_published.json holds the rows (with their citations); tests/test_planner.py and
bench/planner.py check the planner against them. A row's own configuration is pinned (devices,
TP, PP, DP, and what the source states of the schedule and recomputation); the planner chooses the
rest (micro-batch, interleaving, recomputation where unstated) as it would for a user.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lockstep.planner.devices import gpu
from lockstep.planner.search import Pinned, best_trainer
from lockstep.planner.types import ModelShape, TrainCost, TrainLayout, Workload


@dataclass(frozen=True)
class Check:
    id: str
    published_s: float
    predicted_s: float
    layout: TrainLayout
    cost: TrainCost

    @property
    def error(self) -> float:
        return self.predicted_s / self.published_s - 1


def load_rows(path: str | Path) -> tuple[dict, list[dict]]:
    """(conventions, rows), with rows that refer to an earlier row's source or model resolved."""
    data = json.loads(Path(path).read_text())
    by_id: dict[str, dict] = {}
    rows = []
    for raw in data["rows"]:
        row = dict(raw)
        for key in ("source", "model"):
            if isinstance(row[key], str):
                row[key] = by_id[row[key]][key]
        by_id[row["id"]] = row
        rows.append(row)
    return data["flops_conventions"], rows


def shape_of(row: dict) -> ModelShape:
    return ModelShape(**row["model"])


def published_step_s(row: dict) -> float:
    """The step time the source reports, or the one its throughput implies under its FLOP count."""
    pub = row["published"]
    if "step_s" in pub:
        return pub["step_s"]
    shape, tokens = shape_of(row), row["global_batch"] * row["seq_len"]
    assert row["flops_convention"] == "6n_plus_attention", row["flops_convention"]
    per_token = 6 * shape.matmul_params + 12 * shape.num_layers * shape.hidden * row["seq_len"]
    return tokens * per_token / (row["gpus"] * pub["tflops_per_gpu"] * 1e12)


def check(row: dict) -> Check:
    shape = shape_of(row)
    work = Workload("sft", row["global_batch"], row["seq_len"], 0)
    pinned = Pinned(dp=row["dp"], tp=row["tp"], pp=row["pp"], interleave=row.get("interleave"),
                    recompute=row.get("recompute"))
    layout, cost, _, _ = best_trainer(shape, work, gpu(row["device"]), row["gpus"], pinned)
    return Check(row["id"], published_step_s(row), cost.step_s, layout, cost)
