"""What grading one program costs in the code env: `lockstep.envs.code.run_tests` on shipped problems.

    .venv/bin/python bench/code_grading.py [--runs 40] [--rounds 4] [--src OLD/src --src NEW/src]

Each `--src` is a lockstep source tree (e.g. one exported from an older commit with `git archive`):
a child process per (round, tree) grades with that tree's `run_tests`, rounds alternating between
the trees, so before and after are measured side by side in one run. Without `--src`, the
installed lockstep alone. Rows, per tree:

a. latency of grading the reference solution of one problem (`--problem`, default `add`: 4 tests
   of `assert add(a, b) == c`), `--runs` times each way, p50 / p90 ms: "warm", the pools full and
   their interpreters booted before each grading (a trainer with idle time between programs);
   "back to back", one after another (the pools' refills boot beside each grading, as in a burst).
b. CPU per grading over those runs, the sandboxes' processes included: the child's own cpuacct
   cgroup (v1, created here when /sys/fs/cgroup/cpuacct is writable, e.g. as root), which other
   users' load does not touch; else the machine's busy CPU (/proc/stat), meaningful only when quiet.
c. a sweep: the 48 shipped reference solutions, one after another, the mean ms per problem, and
   whether each got reward 1 (a check that the tree grades right, not a timing).

Prints a markdown table; writes bench/.work/code_grading.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

OUT = Path("bench/.work/code_grading.json")


CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def group_cpu() -> float | None:
    """CPU seconds of this process's cpuacct cgroup (v1) when it is one of ours, else None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(",") and "lockstep-bench-" in path:
            return int((CPUACCT / path.lstrip("/") / "cpuacct.usage").read_text()) / 1e9
    return None


def busy_cpu() -> float:
    """CPU seconds the whole machine has spent busy (/proc/stat): a sandbox's processes are not all
    children this process waits for, so its rusage would miss them. Meaningful on a quiet machine."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def child(runs: int, problem_name: str) -> dict:
    """Measure with whatever lockstep is importable (the parent sets PYTHONPATH)."""
    from lockstep.envs.code import SHIPPED, Problem, run_tests
    from lockstep.sandbox.pool import _pools as pools
    from lockstep.sandbox.types import Limits

    limits = Limits()
    rows = [json.loads(line) for line in SHIPPED.read_text().splitlines() if line.strip()]
    problems = {r["entry_point"]: Problem(r["prompt"], tuple(r["tests"]), r["entry_point"], r["solution"]) for r in rows}
    one = problems[problem_name]

    async def grade(p):
        return await run_tests(p.solution, p, limits)

    def settle():  # every pool full and its interpreters booted, as bench/sandbox.py's settle()
        deadline = time.monotonic() + 10
        while any(len(p._idle) < p.ready for p in list(pools.values())) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)

    asyncio.run(grade(one))  # warm imports, and make the pools this tree grades from
    settle()
    warm = []
    for _ in range(runs):
        settle()
        t0 = time.perf_counter()
        out = asyncio.run(grade(one))
        warm.append(time.perf_counter() - t0)
        assert out.passed == out.total, out
    settle()
    cpu = group_cpu if group_cpu() is not None else busy_cpu
    lat, cpu0 = [], cpu()
    for _ in range(runs):
        t0 = time.perf_counter()
        out = asyncio.run(grade(one))
        lat.append(time.perf_counter() - t0)
        assert out.passed == out.total, out
    cpu_s = (cpu() - cpu0) / runs
    settle()
    t0, right = time.perf_counter(), 0
    for p in problems.values():
        out = asyncio.run(grade(p))
        right += out.passed == out.total
    sweep = (time.perf_counter() - t0) / len(problems)
    return {"warm_s": warm, "latency_s": lat, "cpu_s": cpu_s, "cpu_from": cpu.__name__, "sweep_s": sweep, "right": right,
            "problems": len(problems)}


def in_group(name: str):
    """A preexec_fn that puts the child in a new cpuacct cgroup `name` (None when that cannot be made)."""
    try:
        (CPUACCT / name).mkdir()
    except OSError:
        return None

    def enter():
        (CPUACCT / name / "cgroup.procs").write_text(str(os.getpid()))

    return enter


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=40, help="gradings of one problem per round and tree (a, b)")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds")
    ap.add_argument("--problem", default="add", help="entry point of the shipped problem timed in a and b")
    ap.add_argument("--src", action="append", default=[], help="a lockstep source tree (repeatable)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.runs, args.problem)))
        return
    trees = args.src or [""]
    results: dict[str, list[dict]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            env = dict(os.environ)
            if tree:
                env["PYTHONPATH"] = str(Path(tree).resolve())
            group = f"lockstep-bench-{os.getpid()}-{r}-{len(results[tree])}-{trees.index(tree)}"
            try:
                run = subprocess.run([sys.executable, __file__, "--child", "--runs", str(args.runs), "--problem",
                                      args.problem], env=env, capture_output=True, text=True, timeout=1800,
                                     preexec_fn=in_group(group))
            finally:
                try:
                    (CPUACCT / group).rmdir()  # empty once the child and its sandboxes are gone
                except OSError:
                    pass
            if run.returncode:
                sys.exit(f"{tree or 'installed'}: {run.stderr[-2000:]}")
            results[tree].append(json.loads(run.stdout.strip().splitlines()[-1]))
    print(f"CPU from: {sorted({r['cpu_from'] for rs in results.values() for r in rs})}")
    print("| tree | a. warm p50 / p90 ms | a. back to back p50 / p90 ms | b. CPU ms / grading | "
          "c. ms / problem (48) | c. reward 1 |")
    print("|---|---|---|---|---|---|")
    table = {}
    for tree, rs in results.items():
        lat = [x for r in rs for x in r["latency_s"]]
        warm = [x for r in rs for x in r["warm_s"]]
        row = {"warm_p50_ms": 1e3 * pct(warm, 0.5), "warm_p90_ms": 1e3 * pct(warm, 0.9),
               "p50_ms": 1e3 * pct(lat, 0.5), "p90_ms": 1e3 * pct(lat, 0.9),
               "cpu_ms": 1e3 * statistics.median(r["cpu_s"] for r in rs),
               "sweep_ms": 1e3 * statistics.median(r["sweep_s"] for r in rs),
               "right": f"{min(r['right'] for r in rs)}/{rs[0]['problems']}", "n": len(lat)}
        table[tree or "installed"] = row
        print(f"| {tree or 'installed'} | {row['warm_p50_ms']:.1f} / {row['warm_p90_ms']:.1f} | "
              f"{row['p50_ms']:.1f} / {row['p90_ms']:.1f} | {row['cpu_ms']:.1f} | "
              f"{row['sweep_ms']:.1f} | {row['right']} |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"date": str(date.today()), "machine": platform.processor() or platform.machine(),
                               "cpus": os.cpu_count(), "load": os.getloadavg(), "args": vars(args),
                               "table": table, "raw": results}, indent=1))


if __name__ == "__main__":
    main()
