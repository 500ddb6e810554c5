"""What bounding a sandbox as a whole costs: a sandbox's start-to-exit, and a paused turn.

    .venv/bin/python bench/sandbox_startup.py [--runs 40] [--rounds 5] [--before SRC]

Side by side in one run, interleaved in rounds (the machine may be shared), each variant in its
own process:

- "cgroup": this code as the host sets it up (a cgroup per sandbox, a uid of its own as root);
- "no cgroup": this code with LOCKSTEP_SANDBOX_CGROUP=off (the fallback: rlimits and the watch);
- "before": the lockstep package under --before (e.g. `git archive d5a550f src | tar -x -C /tmp/old`
  then --before /tmp/old/src): the sandbox before issue 27.

Per program: `Sandbox(limits)`, a hello program (`print(1)`, mode "program"), `close()` (the
cgroup's removal included): wall p50 / p90, and CPU seconds of the measuring process and its
reaped children (the sandbox's whole tree is reaped through bwrap). Per turn ("cgroup" and "no
cgroup"): a cell, then Sandbox.pause() and the next call's resume, against a cell alone (the
python_tool env pays the difference once per turn). Prints a markdown table; JSON in
bench/.work/sandbox_startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

OUT = Path("bench/.work/sandbox_startup.json")
SRC = Path(__file__).resolve().parent.parent / "src"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def child(runs: int, turns: bool) -> dict:
    """Measured in this process (the variant's code on sys.path)."""
    from lockstep.sandbox.process import Sandbox
    from lockstep.sandbox.types import Limits

    limits = Limits()
    walls, failed, c0 = [], 0, cpu()
    for _ in range(runs):
        t = time.perf_counter()
        sb = Sandbox(limits)
        v = sb.call("print(1)", mode="program")
        sb.close()
        walls.append(time.perf_counter() - t)
        failed += not (v.ok and v.stdout == "1\n")  # counted: d5a550f's watch could call it a memory violation
    out = {"program_s": walls, "cpu_s": (cpu() - c0) / runs, "failed": failed}
    if turns:  # one sandbox calls only; another pauses after each call (its next call resumes it)
        plain, paused = Sandbox(limits), Sandbox(limits)
        out |= {"cell_s": [], "cell_pause_s": []}
        for _ in range(runs):
            for sb, key in ((plain, "cell_s"), (paused, "cell_pause_s")):
                t = time.perf_counter()
                assert sb.call("x = 1").ok
                if sb is paused:
                    sb.pause()
                out[key].append(time.perf_counter() - t)
        plain.close()
        paused.close()
    return out


def run_variant(name: str, src: str, runs: int) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    if name == "no cgroup":
        env["LOCKSTEP_SANDBOX_CGROUP"] = "off"
    r = subprocess.run([sys.executable, __file__, "--child", str(runs), "--turns", str(int(name != "before"))],
                       env=env, capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", default="", help="src directory of the code to compare against")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--turns", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, bool(args.turns))))
        return
    variants = {"cgroup": str(SRC), "no cgroup": str(SRC)} | ({"before": args.before} if args.before else {})
    got: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name, src in variants.items():
            for key, value in run_variant(name, src, args.runs).items():
                got[name].setdefault(key, []).extend(value if isinstance(value, list) else [value])
    rows = {}
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {date.today()}, "
          f"load {load0:.1f} -> {os.getloadavg()[0]:.1f}\n")
    print("| variant | program: p50 ms | p90 ms | CPU ms / program | not ok | cell p50 ms | cell + pause + resume p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for name, m in got.items():
        rows[name] = {"program_p50_ms": pct(m["program_s"], 50) * 1e3, "program_p90_ms": pct(m["program_s"], 90) * 1e3,
                      "cpu_ms": sum(m["cpu_s"]) / len(m["cpu_s"]) * 1e3, "n": len(m["program_s"]),
                      "failed": int(sum(m["failed"]))}
        if "cell_s" in m:
            rows[name] |= {"cell_p50_ms": pct(m["cell_s"], 50) * 1e3, "cell_pause_p50_ms": pct(m["cell_pause_s"], 50) * 1e3}
        r = rows[name]
        print(f"| {name} | {r['program_p50_ms']:.1f} | {r['program_p90_ms']:.1f} | {r['cpu_ms']:.1f} | "
              f"{r['failed']}/{r['n']} | "
              f"{r.get('cell_p50_ms', float('nan')):.2f} | {r.get('cell_pause_p50_ms', float('nan')):.2f} |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"date": str(date.today()), "rows": rows, "runs": args.runs, "rounds": args.rounds,
                               "load": [load0, os.getloadavg()[0]]}, indent=1))


if __name__ == "__main__":
    main()
