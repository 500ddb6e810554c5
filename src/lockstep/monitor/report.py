"""report.html: accuracy and reward curves (matplotlib), speculative decoding's acceptance and
draft lag when it was on, and the per-stage throughput table."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _curves(run_dir: Path, summary: dict) -> list[tuple[str, str]]:
    """(title, base64 PNG) of each chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    images = []
    fig, ax = plt.subplots(figsize=(6, 3.2))
    evals = summary.get("evals", [])
    ax.plot([e["time"] for e in evals], [e["accuracy"] for e in evals], marker="o")
    ax.set_xlabel("wall seconds")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    images.append(("held-out accuracy", _png(fig)))
    plt.close(fig)
    rewards = [(r["step"], r["rollout/reward_mean"]) for r in records if "rollout/reward_mean" in r]
    if rewards:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(*zip(*rewards))
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward (sampled)")
        ax.grid(alpha=0.3)
        images.append(("mean reward", _png(fig)))
        plt.close(fig)
    spec = [r for r in records if "speculative/acceptance" in r]
    if spec:
        images.append(("speculative decoding: acceptance and draft lag", _png(_speculative_chart(plt, spec))))
        plt.close("all")
    return images


def _speculative_chart(plt, records: list[dict]):
    """Acceptance rate and accepted drafts per verify per RL step; a learning draft's lag behind
    the policy (policy versions) on the right axis."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["speculative/acceptance"] for r in records], label="acceptance rate")
    ax.plot(steps, [r["speculative/accepted_per_verify"] for r in records], label="accepted per verify", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("drafts")
    ax.grid(alpha=0.3)
    lag = [(r["step"], r["speculative/draft_lag"]) for r in records if "speculative/draft_lag" in r]
    if lag:
        right = ax.twinx()
        right.plot(*zip(*lag), color="tab:red", label="draft lag (policy versions)")
        right.set_ylabel("draft lag (policy versions)")
        right.legend(loc="upper right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    return fig


def write_report(run_dir: Path, summary: dict) -> Path:
    run_dir = Path(run_dir)
    rows = [
        ("wall seconds", f"{summary['wall_seconds']:.1f}"),
        ("optimizer steps", summary["steps"]),
        ("accuracy start / after SFT / final",
         f"{summary['eval_accuracy_start']:.3f} / {summary['eval_accuracy_after_sft']:.3f} / {summary['eval_accuracy_final']:.3f}"),
        ("generator busy fraction", f"{summary['generator_busy_fraction']:.2f}"),
        ("trainer busy fraction", f"{summary['trainer_busy_fraction']:.2f}"),
        ("max weight publish -> visible (s)", f"{summary['weight_swap_latency_s_max']:.4f}"),
        *[(k, v) for k, v in summary.get("counters", {}).items()],
    ]
    table = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    stages = summary.get("stages", [])
    if stages:
        cols = list(stages[0])
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in cols) + "</tr>" for r in stages)
        table += f"</table><h2>Per-stage throughput and idle time</h2><table><tr>{head}</tr>{body}"
    imgs = "".join(f'<img alt="{html.escape(t)}" title="{html.escape(t)}" src="data:image/png;base64,{b}">'
                   for t, b in _curves(run_dir, summary))
    page = (f"<!doctype html><meta charset=utf-8><title>lockstep run report</title>"
            f"<h1>lockstep run</h1><table>{table}</table>{imgs}")
    path = run_dir / "report.html"
    path.write_text(page)
    return path
