"""`lockstep sandbox run FILE [--json]`: one program under the sandbox and limits that envs use.

Operators run it to check a machine (does bwrap work here, are the limits enforced); tests use it
too. It prints the program's output and the verdict; with --json the last line is the verdict as
one JSON object. Exit status: 0 when the program ran and exited 0, 1 when it did not, 2 when no
sandbox can be made here (or the file cannot be read).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lockstep.sandbox.types import Limits, LimitsError, SandboxUnavailable


def add_parser(sub) -> None:
    sandbox = sub.add_parser("sandbox", help="run a program in the sandbox that runs model-written code")
    sandbox_sub = sandbox.add_subparsers(dest="sandbox_command", required=True)
    run = sandbox_sub.add_parser("run", help="run one Python program sandboxed and print its verdict")
    run.add_argument("file", help="a Python source file ('-': standard input)")
    run.add_argument("--json", action="store_true", help="end with the verdict as one JSON object")
    defaults = Limits()
    for name, kind, unit in (("wall_s", float, "wall-clock seconds"), ("cpu_s", int, "CPU seconds"),
                             ("memory_mb", int, "MiB of address space per process and resident for the tree"),
                             ("processes", int, "processes and threads"), ("file_size_mb", int, "MiB per file written"),
                             ("open_files", int, "open files per process"), ("output_kb", int, "KiB of stdout and of stderr"),
                             ("tmpfs_mb", int, "MiB of private /tmp")):
        run.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=getattr(defaults, name),
                         help=f"{unit} (default {getattr(defaults, name)})")
    run.set_defaults(func=cmd_run)
    fusion = sandbox_sub.add_parser("fusion", help="serve SandboxFusion's POST /run_code from this sandbox "
                                    "(tinker-cookbook's code_rl: SANDBOX_URL=http://HOST:PORT/run_code)")
    fusion.add_argument("--host", default="127.0.0.1")
    fusion.add_argument("--port", type=int, default=8080)
    fusion.add_argument("--max-concurrency", type=int, default=4, help="sandboxes running at once")
    fusion.set_defaults(func=cmd_fusion)


def cmd_run(args) -> int:
    from lockstep.sandbox.bwrap import check_available
    from lockstep.sandbox.pool import run_program_blocking

    try:
        limits = Limits(**{k: getattr(args, k) for k in Limits.__dataclass_fields__})
        code = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8", errors="replace")
        check_available()
    except (LimitsError, OSError, SandboxUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    verdict = run_program_blocking(code, limits, name=args.file)
    if args.json:
        print(json.dumps(verdict.to_json()))
    else:
        sys.stdout.write(verdict.stdout)
        sys.stderr.write(verdict.stderr)
        what = verdict.limit if verdict.status == "limit" else (verdict.error or "")
        print(f"[sandbox] {verdict.status}{': ' + what if what else ''} exit={verdict.exit_code} "
              f"signal={verdict.signal} stdout={verdict.stdout_bytes}B stderr={verdict.stderr_bytes}B "
              f"wall={verdict.wall_s:.3f}s cpu={verdict.cpu_s:.3f}s", file=sys.stderr)
    return 0 if verdict.ok else 1


def cmd_fusion(args) -> int:
    import uvicorn

    from lockstep.sandbox.bwrap import check_available
    from lockstep.sandbox.cookbook import fusion_app

    try:
        check_available()
    except SandboxUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    uvicorn.run(fusion_app(max_concurrency=args.max_concurrency), host=args.host, port=args.port)
    return 0
