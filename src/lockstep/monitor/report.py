"""report.html, one self-contained file: accuracy and reward curves (matplotlib), the pipeline
timeline (trace.jsonl's spans), speculative decoding's acceptance and draft lag when it was on,
and the tables: the run's summary, per-stage throughput, the ledger's counts and the filters'."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _curves(run_dir: Path, summary: dict, records: list[dict]) -> list[tuple[str, str]]:
    """(title, base64 PNG) of each chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    if (run_dir / "trace.jsonl").is_file():
        from lockstep.monitor.trace import read_spans

        spans = read_spans(run_dir / "trace.jsonl")
        if spans:
            images.append(("pipeline timeline", _png(_timeline(plt, spans))))
            plt.close("all")
    spec = [r for r in records if "speculative/acceptance" in r]
    if spec:
        images.append(("speculative decoding: acceptance and draft lag", _png(_speculative_chart(plt, spec))))
        plt.close("all")
    return images


TIMELINE_TRACKS = ("generator", "environments", "trainer", "weights", "evaluation")


def _timeline(plt, spans: list[dict]):
    """Each component's busy intervals over the run (trace.jsonl's spans), one row per track;
    overlapping spans of a row (rollout batches in flight together) are drawn translucent."""
    t0 = min(s["start"] for s in spans)
    tracks = [t for t in TIMELINE_TRACKS if any(s["track"] == t for s in spans)]
    tracks += sorted({s["track"] for s in spans} - set(tracks))
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(tracks)))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for y, track in enumerate(tracks):
        bars = [(s["start"] - t0, max(s["end"] - s["start"], 1e-3)) for s in spans if s["track"] == track]
        ax.broken_barh(bars, (y - 0.35, 0.7), color=colors[y % len(colors)], alpha=0.55, linewidth=0)
    ax.set_yticks(range(len(tracks)), tracks)
    ax.invert_yaxis()
    ax.set_xlabel("wall seconds since the first span")
    ax.grid(alpha=0.3, axis="x")
    return fig


def _ledger_counts(run_dir: Path) -> dict[str, int]:
    from lockstep.monitor.runfile import JsonLines, ledger_counts

    return ledger_counts(JsonLines(run_dir / "ledger.jsonl").new())


def _filter_totals(records: list[dict]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for r in records:
        for k, v in r.items():
            if (k.startswith("filter/") or k == "env/failed_groups") and isinstance(v, (int, float)):
                totals[k] = totals.get(k, 0) + v
    return totals


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
    from lockstep.monitor.runfile import JsonLines

    records = JsonLines(run_dir / "metrics.jsonl").new()
    ledger = "".join(f"<tr><th>groups {html.escape(k)}</th><td>{v}</td></tr>" for k, v in _ledger_counts(run_dir).items())
    filters = "".join(f"<tr><th>{html.escape(k)}</th><td>{v:g}</td></tr>" for k, v in sorted(_filter_totals(records).items()))
    table += f"</table><h2>Ledger and filters (whole run)</h2><table>{ledger}{filters}"
    imgs = "".join(f'<img alt="{html.escape(t)}" title="{html.escape(t)}" src="data:image/png;base64,{b}">'
                   for t, b in _curves(run_dir, summary, records))
    page = (f"<!doctype html><meta charset=utf-8><title>lockstep run report</title>"
            f"<h1>lockstep run</h1><table>{table}</table>{imgs}")
    path = run_dir / "report.html"
    path.write_text(page)
    return path
