"""What the sandbox costs: a program's latency, throughput, the tool env's restore, the code env.

    .venv/bin/python bench/sandbox.py [--runs 100] [--concurrency 8] [--programs 400]

All side by side in one run, on this machine (default limits: `Limits()`):

a. A hello-world program (`print(1)`): a bare `subprocess.run(["/usr/bin/python3", "-c", "print(1)"])`;
   one sandbox started for the program without the pool (`Sandbox(limits).call(code, mode="program")`,
   start included); through the warmed pool (`run_program_blocking`), refilled and booted before each
   call, and back to back (the refill boots beside the call). p50 / p90 of `--runs` each, and the
   machine's CPU per program (/proc/stat; meaningful on a quiet machine).
b. A CPU-bound program of ~200 ms (calibrated here): bare against the pool, alternating, the whole
   program and the loop alone (timed inside it): the overhead.
c. Throughput: `--programs` hello programs from `--concurrency` callers at once, through the pool
   (and bare subprocesses, for scale).
d. The tool env's restore: a `Session` replaying N cells (`x{i} = sum(range(10**5))`, N = 1, 4, 16)
   into a fresh interpreter, against the reference cost of a fork-based snapshot: os.fork() + the
   child's exit + waitpid in a plain python process that has run the same cells.
e. The code env: episodes/s grading the shipped problems' reference solutions with `run_tests`,
   `--concurrency` episodes at once.

Prints a markdown table; writes bench/.work/sandbox.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

from lockstep.envs.code import SHIPPED, Problem, run_tests
from lockstep.sandbox.bwrap import check_available, interpreter
from lockstep.sandbox.pool import READY, Session, pool, run_program_blocking
from lockstep.sandbox.process import Sandbox
from lockstep.sandbox.types import Limits

PY = "/usr/bin/python3"
HELLO = "print(1)"
OUT = Path("bench/.work/sandbox.json")
FORK_REF = r"""
import json, os, sys, time
n, reps = int(sys.argv[1]), int(sys.argv[2])
ns = {}
for i in range(n):
    exec(f"x{i} = sum(range(10**5))", ns)
out = []
for _ in range(reps):
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    out.append(time.perf_counter() - t)
print(json.dumps(out))
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ms(xs: list[float]) -> dict:
    return {"p50_ms": round(pct(xs, 50) * 1e3, 2), "p90_ms": round(pct(xs, 90) * 1e3, 2), "n": len(xs)}


def timed(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def bare(code: str) -> str:
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def fresh_sandbox(code: str, limits: Limits) -> None:
    sb = Sandbox(limits)
    try:
        v = sb.call(code, mode="program")
    finally:
        sb.close()
    assert v.ok, v


def pooled(code: str, limits: Limits) -> str:
    v = run_program_blocking(code, limits)
    assert v.ok, v
    return v.stdout


def settle(limits: Limits, timeout: float = 10.0) -> None:
    """Wait until the pool for `limits` holds its ready sandboxes again, and their interpreters have
    had time to boot (a pool hands out a sandbox as soon as bwrap is spawned): the steady state of a
    trainer with idle time between programs."""
    p, deadline = pool(limits), time.monotonic() + timeout
    while len(p._idle) < p.ready and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)


def busy_cpu() -> float:
    """CPU seconds the whole machine has spent busy (/proc/stat): a sandbox's processes are not all
    children this process waits for, so its rusage would miss them. Meaningful on a quiet machine."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_loop(n: int) -> str:
    """The loop prints its own seconds: the compute alone, without the interpreter's start."""
    return (f"import time\nt = time.perf_counter()\ns = 0\nfor i in range({n}):\n    s += i * i\n"
            f"print(time.perf_counter() - t)\n")


def calibrate_cpu(target_s: float) -> str:
    """A program whose loop takes about `target_s` in a bare interpreter (startup not counted)."""
    n = 10**6
    t = min(float(bare(cpu_loop(n))) for _ in range(3))
    return cpu_loop(int(n * target_s / max(t, 1e-3)))


def throughput(fn, programs: int, concurrency: int) -> float:
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(lambda _: fn(), range(programs)))
    return programs / (time.perf_counter() - t)


def replay(n: int, limits: Limits) -> float:
    cells = [f"x{i} = sum(range(10**5))" for i in range(n)]
    t = time.perf_counter()
    s = Session(limits)
    try:
        for c in cells:
            v = s.cell_blocking(c)
            assert v.ok, v
    finally:
        elapsed = time.perf_counter() - t
        s.close()
    return elapsed


def fork_reference(n: int, reps: int) -> list[float]:
    r = subprocess.run([PY, "-c", FORK_REF, str(n), str(reps)], capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def code_env(concurrency: int, limits: Limits, passes: int) -> tuple[float, int]:
    rows = [json.loads(line) for line in SHIPPED.read_text().splitlines() if line.strip()]
    problems = [Problem(r["prompt"], tuple(r["tests"]), r.get("entry_point", ""), r["solution"]) for r in rows] * passes

    async def main():
        gate = asyncio.Semaphore(concurrency)

        async def one(p):
            async with gate:
                out = await run_tests(p.solution, p, limits)
                assert out.passed == out.total, out

        t = time.perf_counter()
        await asyncio.gather(*(one(p) for p in problems))
        return time.perf_counter() - t

    seconds = asyncio.run(main())
    return len(problems) / seconds, len(problems)


def machine() -> dict:
    cpu = "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "sandbox_python": interpreter(), "kernel": platform.release(), "date": date.today().isoformat()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100, help="latency samples per variant (a)")
    ap.add_argument("--cpu-runs", type=int, default=20, help="samples of the CPU-bound program (b)")
    ap.add_argument("--concurrency", type=int, default=8, help="concurrent callers (c) and episodes (e)")
    ap.add_argument("--programs", type=int, default=400, help="programs for the throughput (c)")
    ap.add_argument("--replays", type=int, default=20, help="replays per cell count (d)")
    ap.add_argument("--passes", type=int, default=4, help="passes over the shipped problems (e)")
    args = ap.parse_args()
    check_available()
    limits = Limits()
    t_start = time.perf_counter()
    rows: list[dict] = []
    result: dict = {"bench": "sandbox", "machine": machine(), "limits": limits.__dict__, "args": vars(args),
                    "loadavg_start": os.getloadavg()}

    # a. hello world
    for _ in range(2 * READY):
        pooled(HELLO, limits)
    settle(limits)
    c0 = busy_cpu()
    a_bare = timed(lambda: bare(HELLO), args.runs)
    c1 = busy_cpu()
    a_fresh = timed(lambda: fresh_sandbox(HELLO, limits), args.runs)
    c2 = busy_cpu()
    cpu_per = {"bare_ms": round((c1 - c0) / args.runs * 1e3, 1), "sandbox_ms": round((c2 - c1) / args.runs * 1e3, 1)}
    a_pool = []
    for _ in range(args.runs):
        settle(limits)
        a_pool += timed(lambda: pooled(HELLO, limits), 1)
    a_pool_busy = timed(lambda: pooled(HELLO, limits), args.runs)  # back to back: refills compete
    result["a_hello"] = {"bare": ms(a_bare), "sandbox_unpooled": ms(a_fresh), "pool": ms(a_pool),
                         "pool_back_to_back": ms(a_pool_busy), "cpu_per_program": cpu_per}
    for name, xs in (("bare subprocess", a_bare), ("sandbox, started per program", a_fresh),
                     ("sandbox, warm pool", a_pool), ("sandbox, pool back to back", a_pool_busy)):
        rows.append({"what": f"a. hello: {name}", **ms(xs)})

    # b. CPU-bound ~200 ms
    cpu_code = calibrate_cpu(0.2)
    settle(limits)
    b_bare, b_pool, loop_bare, loop_pool = [], [], [], []
    for _ in range(args.cpu_runs):  # alternating, so that drift in the machine's speed hits both
        t = time.perf_counter()
        loop_bare.append(float(bare(cpu_code)))
        b_bare.append(time.perf_counter() - t)
        settle(limits)
        t = time.perf_counter()
        loop_pool.append(float(pooled(cpu_code, limits)))
        b_pool.append(time.perf_counter() - t)
    over = pct(b_pool, 50) - pct(b_bare, 50)
    loop_over = pct(loop_pool, 50) - pct(loop_bare, 50)
    result["b_cpu"] = {"bare": ms(b_bare), "pool": ms(b_pool), "loop_bare": ms(loop_bare), "loop_pool": ms(loop_pool),
                       "overhead_p50_ms": round(over * 1e3, 2),
                       "overhead_p50_pct": round(100 * over / pct(b_bare, 50), 1),
                       "loop_overhead_p50_pct": round(100 * loop_over / pct(loop_bare, 50), 1)}
    rows.append({"what": "b. ~200 ms CPU: bare subprocess, whole program", **ms(b_bare)})
    rows.append({"what": f"b. ~200 ms CPU: sandbox, warm pool, whole program ({100 * over / pct(b_bare, 50):+.1f}%)",
                 **ms(b_pool)})
    rows.append({"what": "b. ~200 ms CPU: the loop alone, bare", **ms(loop_bare)})
    rows.append({"what": f"b. ~200 ms CPU: the loop alone, sandboxed ({100 * loop_over / pct(loop_bare, 50):+.1f}%)",
                 **ms(loop_pool)})

    # c. throughput
    settle(limits)
    c_pool = throughput(lambda: pooled(HELLO, limits), args.programs, args.concurrency)
    c_bare = throughput(lambda: bare(HELLO), args.programs, args.concurrency)
    result["c_throughput"] = {"pool_programs_per_s": round(c_pool, 1), "bare_programs_per_s": round(c_bare, 1),
                              "concurrency": args.concurrency, "programs": args.programs}
    rows.append({"what": f"c. hello, {args.concurrency} callers: sandbox pool", "p50_ms": None, "p90_ms": None,
                 "n": args.programs, "per_s": round(c_pool, 1)})
    rows.append({"what": f"c. hello, {args.concurrency} callers: bare subprocess", "p50_ms": None, "p90_ms": None,
                 "n": args.programs, "per_s": round(c_bare, 1)})

    # d. tool-env restore: replay N cells vs fork
    result["d_restore"] = {}
    for n in (1, 4, 16):
        xs = []
        for _ in range(args.replays):
            settle(limits)
            xs.append(replay(n, limits))
        fk = fork_reference(n, args.replays * 3)
        result["d_restore"][n] = {"replay": ms(xs), "fork": ms(fk)}
        rows.append({"what": f"d. restore {n} cells: replay into a fresh Session", **ms(xs)})
        rows.append({"what": f"d. restore {n} cells: os.fork() of a plain python (reference)", **ms(fk)})

    # e. code env
    settle(limits)
    eps, episodes = code_env(args.concurrency, limits, args.passes)
    result["e_code_env"] = {"episodes_per_s": round(eps, 1), "episodes": episodes, "concurrency": args.concurrency}
    rows.append({"what": f"e. code env, shipped reference solutions, {args.concurrency} at once", "p50_ms": None,
                 "p90_ms": None, "n": episodes, "per_s": round(eps, 1)})

    result["rows"] = rows
    result["loadavg_end"] = os.getloadavg()
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    pool(limits).close()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))

    m = result["machine"]
    print(f"{m['cpu']}, {m['cores']} CPUs, Python {m['python']} (sandbox: {m['sandbox_python']}), {m['date']}")
    print("| what | p50 (ms) | p90 (ms) | n | per s |")
    print("|---|---|---|---|---|")
    for r in rows:
        cell = (lambda v: "" if v is None else f"{v:,.1f}")
        print(f"| {r['what']} | {cell(r.get('p50_ms'))} | {cell(r.get('p90_ms'))} | {r['n']} | "
              f"{cell(r.get('per_s'))} |")
    print(f"machine CPU per hello program (/proc/stat, every process): bare {cpu_per['bare_ms']} ms, "
          f"sandbox {cpu_per['sandbox_ms']} ms")
    print(f"load average at start / end: {result['loadavg_start'][0]:.2f} / {result['loadavg_end'][0]:.2f}")
    print(f"wrote {OUT} ({result['seconds']} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
