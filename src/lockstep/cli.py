"""The `lockstep` command: a thin layer over the library (run | check)."""

from __future__ import annotations

import argparse
import json
import sys


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockstep", description="RL post-training with bit-for-bit consistency")
    sub = parser.add_subparsers(dest="command", required=True)
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
    args = build_parser().parse_args(argv)
    from lockstep.engine.types import EngineError

    try:
        return args.func(args)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
