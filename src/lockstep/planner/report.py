"""The strategy as a person reads it (a rich table) and as a program reads it (JSON)."""

from __future__ import annotations

from lockstep.planner.types import GIB, Strategy, Workload

SCHEMA_KEYS = ("device", "devices", "generator_devices", "trainer_devices", "generator_replicas", "generator_tp",
               "trainer", "max_staleness", "step_s", "train", "trainer_memory_gib", "considered", "refused", "notes")
"""Keys every strategy's JSON has; RL plans add "generate", "generator_memory_gib" and "simulation"."""


def as_json(strategy: Strategy, work: Workload) -> dict:
    out = strategy.as_dict()
    out["workload"] = {"kind": work.kind, "sequences": work.sequences, "prompt_tokens": work.prompt_tokens,
                       "completion_tokens": work.completion_tokens, "group_size": work.group_size,
                       "max_staleness_allowed": work.max_staleness}
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def table(strategy: Strategy, work: Workload):
    from rich.table import Table

    s, t = strategy, strategy.trainer
    out = Table(title=f"lockstep plan: {s.devices} x {s.device}", show_header=True)
    out.add_column("what")
    out.add_column("plan")
    out.add_row("workload", f"{work.kind}: {work.sequences} sequences of {work.prompt_tokens} + "
                            f"{work.completion_tokens} tokens a step")
    if s.generate is not None:
        out.add_row("split (generator : trainer)", f"{s.generator_devices} : {s.trainer_devices}")
        out.add_row("generator", f"{s.generator_replicas} replica(s) x {s.generator_tp} device(s), "
                                 f"{s.generate.rows} rows each, {_ms(s.generate.batch_s)} a batch, "
                                 f"{s.generate.tokens_per_s:,.0f} tokens/s a replica")
        out.add_row("generator memory / device", f"{s.generate.memory.total / GIB:.3g} GiB ({s.generate.memory.describe()})")
    out.add_row("trainer", f"DP {t.dp} x TP {t.tp} x PP {t.pp}, micro-batch {t.micro_batch}, "
                           f"interleave {t.interleave}, recompute {t.recompute}; {_ms(s.train.step_s)} a step")
    c = s.train
    out.add_row("trainer step", f"compute {_ms(c.compute_s)}, bubble {_ms(c.bubble_s)}, TP {_ms(c.tp_comm_s)}, "
                                f"PP {_ms(c.pp_comm_s)}, DP {_ms(c.dp_comm_s)}, optimizer {_ms(c.optimizer_s)}")
    out.add_row("trainer memory / device", f"{c.memory.total / GIB:.3g} GiB ({c.memory.describe()})")
    if s.simulation is not None:
        sim = s.simulation
        out.add_row("staleness bound", f"{s.max_staleness} (mean staleness {sim.mean_staleness:.2f}; "
                                       f"weight sync {_ms(sim.sync_s)})")
        out.add_row("busy", f"generator {sim.generator_busy:.0%}, trainer {sim.trainer_busy:.0%}")
    out.add_row("predicted step", f"[bold]{_ms(s.step_s)}[/bold]")
    for note in s.notes:
        out.add_row("note", note)
    return out
