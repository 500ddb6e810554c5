"""The `lockstep` command: a thin layer over the library (run | check)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _cmd_check_consistency(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from lockstep.engine import consistency
    from lockstep.engine.tiny import ensure_tiny_model

    model_dir = args.model or str(ensure_tiny_model())
    report = consistency.run(model_dir, seed=args.seed, max_tokens=args.max_tokens)
    console = Console(stderr=args.json)
    table = Table(title=f"sampler vs trainer logprobs — {model_dir}")
    for col in ("path", "lora", "batch", "tokens", "bitwise equal", "max |Δlogp|"):
        table.add_column(col)
    for name, cases in (("lockstep", report["cases"]), ("transformers", report["hf"]["cases"])):
        for c in cases:
            table.add_row(name, str(c["lora"]), str(c["batch"]), str(c["tokens"]), str(c["equal"]), f"{c['max_abs_diff']:.3g}")
    console.print(table)
    ok = report["tokens_bitwise_equal"] == report["tokens_compared"]
    console.print(
        f"lockstep: {report['tokens_bitwise_equal']}/{report['tokens_compared']} tokens bitwise equal; "
        f"transformers: {report['hf']['tokens_bitwise_equal']}/{report['hf']['tokens_compared']}, "
        f"max |Δlogp| {report['hf']['max_abs_diff']:.3g}"
    )
    if args.json:
        print(json.dumps(report))
    return 0 if ok else 1


def _load_spec(args):
    import dataclasses

    from lockstep.config import ConfigError, load

    if args.resume:
        if args.config or args.overrides:
            raise ConfigError("--resume continues a run with its own config.json; drop the config and overrides")
        path = Path(args.resume) / "config.json"
        if not path.is_file():
            raise ConfigError(f"--resume {args.resume}: no config.json there (is it a run directory?)")
        from lockstep.config import from_dict

        spec = from_dict(json.loads(path.read_text()))
    else:
        spec = load(args.config, args.overrides)
    if args.ray_address:
        spec = dataclasses.replace(spec, runtime=dataclasses.replace(spec.runtime, ray_address=args.ray_address))
    return spec


def _cmd_run(args) -> int:
    import time

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from lockstep.runtime.plan import make_plan
    from lockstep.runtime.run import check_losses

    spec = _load_spec(args)
    check_losses(spec)
    plan = make_plan(spec)
    console = Console()
    if args.dry_run:
        from lockstep.config import to_dict

        print(json.dumps({"config": to_dict(spec), "plan": plan.as_dict()}, indent=2))
        return 0
    from lockstep.runtime.run import run

    run_dir = args.resume or args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
    console.print(f"[bold]lockstep run[/bold] -> {run_dir}" + (" (resuming)" if args.resume else ""))
    total = sum(s.steps for s in spec.stages)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task("starting", total=total, info="")

        def progress(step, what, acc, reward=None):
            info = f"acc {acc:.2f}" + (f"  reward {reward:.2f}" if reward is not None else "")
            bar.update(task, completed=step, description=what, info=info)

        summary = run(spec, Path(run_dir), progress, resume=bool(args.resume))
    console.print(
        f"accuracy: start {summary['eval_accuracy_start']:.2f} -> after SFT {summary['eval_accuracy_after_sft']:.2f}"
        f" -> final {summary['eval_accuracy_final']:.2f} in {summary['wall_seconds']:.0f}s; "
        f"report: {run_dir}/report.html"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockstep", description="RL post-training with bit-for-bit consistency")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a training job (default: the embedded SFT + GRPO arithmetic run)")
    run.add_argument("config", nargs="?", help="TOML run config (default: the embedded default)")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rl.max_staleness=2")
    run.add_argument("--run-dir", help="where to write the run (default: runs/<timestamp>)")
    run.add_argument("--ray-address", help="join an existing Ray cluster instead of starting one")
    run.add_argument("--dry-run", action="store_true", help="print the resolved config and plan, then exit")
    run.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its newest checkpoint")
    run.set_defaults(func=_cmd_run)
    check = sub.add_parser("check", help="self-checks")
    check_sub = check.add_subparsers(dest="check", required=True)
    cons = check_sub.add_parser("consistency", help="sampler vs trainer logprobs, bit for bit")
    cons.add_argument("--model", help="local HF model directory (default: the built-in tiny model)")
    cons.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    cons.add_argument("--seed", type=int, default=0)
    cons.add_argument("--max-tokens", type=int, default=16)
    cons.set_defaults(func=_cmd_check_consistency)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow options (`run cfg.toml --run-dir D rl.steps=5`), which argparse alone
    # cannot interleave with positionals.
    if extra and args.command == "run" and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from lockstep.config import ConfigError
    from lockstep.engine.types import EngineError

    if getattr(args, "config", None) and "=" in args.config:  # only overrides were given
        args.overrides, args.config = [args.config, *args.overrides], None
    try:
        return args.func(args)
    except (EngineError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
