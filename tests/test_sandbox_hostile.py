"""Hostile programs against the sandbox, graded by the code env as a trainer would grade them.

Each program in tests/hostile/ is the *solution* of a one-test problem (`assert solve() == 1`), and
its solve() attacks the host and returns 1 only if the attack worked (it read the secret, reached
the port, outlived the sandbox, ...): a reward of 0 means the attack was contained, not that the
program was broken. Placeholders in the programs (@HOST_TMP@, @PORT@, ...) are filled in with
this run's canaries. They all run at once, with small limits, next to correct control programs
that must still get reward 1 (a kill(-1) or a fork bomb must not reach a neighbour). Then the host
is checked: no process left over, no host process stopped or killed, canary files unchanged, no
marker file anywhere a program tried, memory back, the host's listener still answering.

Also: `lockstep sandbox run --json`, limits validation, and the shipped code problems (reference
solutions pass, stubs fail). tests/hostile/grading/ holds attacks on the grading itself (a patched
launcher, builtins, print, repr, type or __import__, a forged answer on the control pipe, objects
that compare true, an int subclass, `bool = lambda *a: True`, SystemExit in a test, reading the
tests from frames or an audit hook, exiting early): they pass no test, since the tests run in a
sandbox of their own (sandbox/grading.py), and each wins against the judge before issue 27
(tests/old_code_judge.py), their control.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from old_code_judge import run_tests_naive, run_tests_old
from required import require_sandbox

from lockstep.envs.code import SHIPPED, Outcome, Problem, run_tests
from lockstep.sandbox import cgroup, uids
from lockstep.sandbox.bwrap import SANDBOX_UID, spawn_user
from lockstep.sandbox.pool import close_pools, pool, run_program_blocking
from lockstep.sandbox.types import Limits, LimitsError

HOSTILE = Path(__file__).parent / "hostile"
PROGRAMS = sorted(p.stem for p in HOSTILE.glob("*.py"))
GRADING = sorted(p.stem for p in (HOSTILE / "grading").glob("*.py"))
LIMITS = Limits(wall_s=3, cpu_s=1, memory_mb=256, processes=16, output_kb=16, file_size_mb=8, tmpfs_mb=32)
PROBLEM = Problem("Write solve() returning 1.", ("assert solve() == 1",), "solve")
CONTROL = "def solve():\n    return 1\n"
CONTROLS = 4
REPO = Path(__file__).resolve().parent.parent
SETTLE_S = 15.0
MEMORY_SLACK_MB = 500
EXPECTED_REASONS = {"huge_output": {"violation"}, "sleep_forever": {"timeout"},
                    "infinite_loop": {"violation", "timeout"}}
"""Where the way it was stopped is certain; every other program's reason is only recorded."""


# -- the host: canaries, a listener, a victim process -------------------------------------------------
@dataclass
class Host:
    dir: Path
    token: str
    marker: str
    port: int
    abstract: str
    secret_name: str
    victim: subprocess.Popen
    host_ip: str
    stop: threading.Event = field(default_factory=threading.Event)

    def subs(self) -> dict[str, str]:
        return {"@HOST_TMP@": str(self.dir), "@TOKEN@": self.token, "@MARKER@": self.marker,
                "@PORT@": str(self.port), "@ABSTRACT@": self.abstract, "@SECRET_NAME@": self.secret_name,
                "@VICTIM_PID@": str(self.victim.pid), "@HOST_PID@": str(os.getpid()), "@HOST_IP@": self.host_ip,
                "@HOST_HOME@": os.environ.get("HOME", "/root"), "@REPO@": str(REPO),
                "@MEMORY_MB@": str(LIMITS.memory_mb), "@TMPFS_MB@": str(LIMITS.tmpfs_mb),
                "@PROCESSES@": str(LIMITS.processes), "@OPEN_FILES@": str(LIMITS.open_files),
                "@SANDBOX_MEMORY_MB@": str(cgroup.memory_max_mb(LIMITS)), "@SOLUTIONS@": str(SHIPPED),
                "@SOLUTIONS_TREE@": str(SHIPPED.parents[3])}

    def program(self, path: Path) -> str:
        code = path.read_text()
        for key, value in self.subs().items():
            code = code.replace(key, value)
        left = re.findall(r"@[A-Z_]+@", code)
        assert not left, f"{path.name}: unknown placeholders {left}"
        return code

    def files(self) -> dict[str, str]:
        """Name -> sha256 of every file in the host's directory."""
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
                for p in sorted(self.dir.iterdir())}

    def banner(self) -> bytes:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.settimeout(5)
            return s.recv(256)


def _host_ip() -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _serve(sock: socket.socket, banner: bytes, stop: threading.Event) -> None:
    sock.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = sock.accept()
        except OSError:
            continue
        try:
            conn.sendall(banner)
        except OSError:
            pass
        conn.close()
    sock.close()


@pytest.fixture(scope="module")
def host():
    require_sandbox()
    token = secrets.token_hex(16)
    # Under /tmp and world-writable (not pytest's 0700 tmp_path): only the sandbox stands between
    # the programs, which run as an unprivileged uid, and these files.
    d = Path(tempfile.mkdtemp(prefix="lockstep-hostile-", dir="/tmp"))
    d.chmod(0o777)
    (d / "canary.txt").write_text(token + "\n")
    con = sqlite3.connect(d / "service.db")
    con.execute("CREATE TABLE api_keys (tenant TEXT, key TEXT)")
    con.execute("INSERT INTO api_keys VALUES ('alice', ?)", (f"sk-{token}",))
    con.commit()
    con.close()
    for name in ("canary.txt", "service.db"):
        (d / name).chmod(0o666)
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", 0))
    tcp.listen(64)
    abstract = f"lockstep-hostile-{token[:8]}"
    unix_abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_abstract.bind("\0" + abstract)
    unix_abstract.listen(16)
    unix_file = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_file.bind(str(d / "host.sock"))
    (d / "host.sock").chmod(0o777)
    unix_file.listen(16)
    # A host process of the sandboxes' own outer uid: the one a kill or a ptrace could reach.
    victim = subprocess.Popen(["sleep", "900"], stdin=subprocess.DEVNULL, start_new_session=True, **spawn_user())
    secret_name = "LOCKSTEP_TEST_FAKE_API_KEY"
    old_secret = os.environ.get(secret_name)
    os.environ[secret_name] = f"sk-{token}"
    h = Host(d, token, f"lockstep-hostile-{secrets.token_hex(6)}", tcp.getsockname()[1], abstract, secret_name,
             victim, _host_ip())
    threads = [threading.Thread(target=_serve, args=(s, f"banner {token}\n".encode(), h.stop), daemon=True)
               for s in (tcp, unix_abstract, unix_file)]
    for t in threads:
        t.start()
    try:
        yield h
    finally:
        h.stop.set()
        for t in threads:
            t.join(timeout=5)
        try:
            os.kill(victim.pid, 18)  # SIGCONT, should a failed run have stopped it
        except OSError:
            pass
        victim.kill()
        victim.wait()
        if old_secret is None:
            os.environ.pop(secret_name, None)
        else:
            os.environ[secret_name] = old_secret
        shutil.rmtree(d, ignore_errors=True)


# -- the host's processes ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    uid: int
    comm: str
    state: str
    start: int
    cmdline: bytes
    rss_mb: float


def processes() -> dict[int, Proc]:
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            status = Path(f"/proc/{name}/status").read_text()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        close = stat.rindex(")")
        fields = stat[close + 2:].split()
        uid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:"))
        rss = next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0.0)
        out[int(name)] = Proc(int(name), int(fields[1]), uid, stat[stat.index("(") + 1:close], fields[0],
                              int(fields[19]), cmdline, rss)
    return out


def _sandbox_uid(uid: int) -> bool:
    return uid == SANDBOX_UID or uids.in_pool(uid)


def leftovers(before: dict[int, Proc], now: dict[int, Proc], marker: str) -> list[Proc]:
    """Processes started by the corpus that are still there: ours (under this test process), any
    with a program's marker in its command line, and any of the sandbox uid that no bubblewrap holds
    (escaped). Another process's sandboxes (a concurrent test run) are none of ours."""
    me, known = os.getpid(), {(p.pid, p.start) for p in before.values()}
    out = []
    for p in now.values():
        if (p.pid, p.start) in known:
            continue
        chain, q = [], p
        while q is not None and q.pid not in (0, 1) and len(chain) < 64:
            chain.append(q)
            q = now.get(q.ppid)
        ours = any(c.pid == me for c in chain) and p.pid != me
        escaped = os.geteuid() == 0 and _sandbox_uid(p.uid) and not any(c.comm == "bwrap" for c in chain)
        if ours or escaped or marker.encode() in p.cmdline:
            out.append(p)
    return out


def test_leftover_check_sees_a_survivor():
    """The host check itself: a process of ours that outlives its run, under a marker, is seen."""
    marker = f"lockstep-hostile-{secrets.token_hex(6)}"
    close_pools(wait=True)  # earlier tests' pools refill in the background: their sandboxes are not survivors
    before = processes()
    survivor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        # Popen returns once the child exists; its command line is the marked one after its exec.
        while not (now := processes()).get(survivor.pid) or marker.encode() not in now[survivor.pid].cmdline:
            assert survivor.poll() is None, "the survivor exited"
            time.sleep(0.02)
        assert [p.pid for p in leftovers(before, now, marker)] == [survivor.pid]
    finally:
        survivor.kill()
        survivor.wait()
    assert leftovers(before, processes(), marker) == []


def others_growth_mb(before: dict[int, Proc], now: dict[int, Proc]) -> float:
    """How much more resident memory processes that are not this test's hold now (the machine may
    be shared: what another user's processes took is no sandbox's doing). Processes of the sandbox
    uid are never counted as another's: an escaped one would hide here."""
    me, grown = os.getpid(), 0.0
    for p in now.values():
        if os.geteuid() == 0 and _sandbox_uid(p.uid):
            continue
        q, chain = p, 0
        while q is not None and q.pid not in (0, 1, me) and chain < 64:
            q, chain = now.get(q.ppid), chain + 1
        if q is not None and q.pid == me:
            continue
        old = before.get(p.pid)
        grown += max(0.0, p.rss_mb - (old.rss_mb if old is not None and old.start == p.start else 0.0))
    return grown


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


MARKER_DIRS = ["/", "/tmp", "/usr", "/usr/bin", "/usr/lib", "/bin", "/lib", "/var/tmp", "/dev/shm", "/work",
               str(REPO), str(REPO / "src"), os.environ.get("HOME", "/root")]


def marker_files(host: Host) -> list[str]:
    import sysconfig

    dirs = MARKER_DIRS + [str(host.dir), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"],
                          "/usr/lib/python3/dist-packages"]
    found = []
    for d in dirs:
        try:
            found += [f"{d}/{n}" for n in os.listdir(d) if host.marker in n]
        except OSError:
            pass
    return found


# -- the corpus ---------------------------------------------------------------------------------------
@dataclass
class Corpus:
    outcomes: dict[str, Outcome]
    controls: list[Outcome]
    seconds: float
    before: dict[int, Proc]
    after: dict[int, Proc]
    left: list[Proc]
    mem_before: float
    mem_after: float
    """MemAvailable, plus what other users' processes grew by meanwhile."""
    files_before: dict[str, str]
    files_after: dict[str, str]
    markers: list[str]


def _grade_all(codes: list[str], problem: Problem, limits: Limits) -> list[Outcome]:
    async def main():
        return await asyncio.gather(*(run_tests(c, problem, limits) for c in codes))

    return asyncio.run(main())


@pytest.fixture(scope="module")
def corpus(host) -> Corpus:
    files_before, mem_before = host.files(), mem_available_mb()
    before = processes()
    jobs = [(name, host.program(HOSTILE / f"{name}.py")) for name in PROGRAMS]
    step = max(1, len(jobs) // CONTROLS)
    for i in range(CONTROLS):  # spread among the attacks, so that they run beside them
        jobs.insert(i * (step + 1), (f"control-{i}", CONTROL))
    t0 = time.monotonic()
    results = _grade_all([code for _, code in jobs], PROBLEM, LIMITS)
    seconds = time.monotonic() - t0
    outcomes = {name: out for (name, _), out in zip(jobs, results)}
    # The pools keep started sandboxes for these limits (grading's two kinds among them): close them
    # (and any a refill adds late), then give killed trees a moment to be reaped.
    deadline = time.monotonic() + SETTLE_S
    while True:
        close_pools()
        now = processes()
        left = leftovers(before, now, host.marker)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # A dead sandbox's namespaces (its tmpfs, its IPC objects) are freed by the kernel a little later.
    deadline = time.monotonic() + SETTLE_S
    while (mem_available_mb() + others_growth_mb(before, processes()) < mem_before - MEMORY_SLACK_MB
           and time.monotonic() < deadline):
        time.sleep(0.25)
    now = processes()
    mem_after = mem_available_mb() + others_growth_mb(before, now)
    for name in PROGRAMS + [n for n in outcomes if n.startswith("control")]:
        out = outcomes[name]
        print(f"  {name:24s} passed={out.passed}/{out.total} reason={out.reason}")
    print(f"  corpus of {len(jobs)} programs graded in {seconds:.1f}s")
    return Corpus({n: outcomes[n] for n in PROGRAMS}, [outcomes[f"control-{i}"] for i in range(CONTROLS)], seconds,
                  before, now, left, mem_before, mem_after, files_before, host.files(), marker_files(host))


def test_corpus_is_large_enough():
    assert len(PROGRAMS) >= 22, PROGRAMS
    for name in PROGRAMS:
        first = (HOSTILE / f"{name}.py").read_text().splitlines()[0]
        assert first.startswith("# Attacks"), f"{name}.py must start with a comment saying what it attacks"


@pytest.mark.parametrize("name", PROGRAMS)
def test_attack_is_contained(corpus, name, record_property):
    out = corpus.outcomes[name]
    record_property("reason", out.reason)
    assert out.total == 1
    assert out.passed / out.total == 0, f"{name}: NOT contained (reward {out.passed}/{out.total}, {out.reason})"
    assert out.reason != "missing_entry_point", f"{name}: the program is broken (no solve), it tests nothing"
    if name in EXPECTED_REASONS:
        assert out.reason in EXPECTED_REASONS[name], f"{name}: stopped by {out.reason}"


def test_neighbours_unaffected(corpus):
    """Correct programs graded beside the attacks (same limits, same uid) still get reward 1."""
    assert [o.passed for o in corpus.controls] == [1] * CONTROLS, corpus.controls
    # How long the corpus took is printed, never asserted (speed is for bench/): that no
    # attack holds the grading past its limits is each attack's own verdict (EXPECTED_REASONS:
    # sleep_forever ends as a timeout), and the controls beside them passing is this test.


def test_host_unharmed(corpus, host):
    assert not corpus.left, "processes left over after the corpus: " + "; ".join(
        f"pid {p.pid} uid {p.uid} {p.comm} ({p.cmdline[:80]!r})" for p in corpus.left)
    stopped = [p for pid, p in corpus.after.items() if p.state in "tT" and pid in corpus.before
               and corpus.before[pid].start == p.start and corpus.before[pid].state not in "tT"]
    assert not stopped, f"host processes stopped: {stopped}"
    assert host.victim.poll() is None, "the host's victim process was killed"
    assert corpus.after[host.victim.pid].state not in "tT", "the host's victim process was stopped"
    assert corpus.files_after == corpus.files_before, "the host's directory changed"
    assert (host.dir / "canary.txt").read_text().strip() == host.token
    assert not corpus.markers, f"marker files created on the host: {corpus.markers}"
    assert corpus.mem_after >= corpus.mem_before - MEMORY_SLACK_MB, \
        f"MemAvailable {corpus.mem_before:.0f} MiB before, {corpus.mem_after:.0f} after (others' growth added back)"
    assert host.banner() == f"banner {host.token}\n".encode(), "the host's listener stopped answering"
    assert os.environ[host.secret_name] == f"sk-{host.token}"


def test_program_mode_leaves_nothing(host):
    """As one program (`run_program_blocking`, the program's process exits after solve()), the
    spinner and the daemon it leaves behind die with its sandbox, at once."""
    names = ["orphan_spinner", "daemon"]
    before = processes()
    with ThreadPoolExecutor(len(names)) as ex:
        verdicts = list(ex.map(lambda n: run_program_blocking(host.program(HOSTILE / f"{n}.py") + "\nprint(solve())\n",
                                                              LIMITS), names))
    for name, v in zip(names, verdicts):
        assert v.status == "ok" and v.stdout == "0\n", (name, v)
        assert v.wall_s < LIMITS.wall_s, (name, v)  # the sandbox's own figure: ended, not held to its wall limit
    deadline = time.monotonic() + SETTLE_S
    while (left := [p for p in leftovers(before, processes(), host.marker) if host.marker.encode() in p.cmdline]) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left running after the program exited: {left}"
    pool(LIMITS).close()


def _cli(args: list[str], *, code: str | None = None, env: dict | None = None, timeout: float = 60):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code or "")
    try:
        return subprocess.run([sys.executable, "-m", "lockstep.cli", "sandbox", "run", f.name, *args],
                              capture_output=True, text=True, timeout=timeout, env=env or dict(os.environ))
    finally:
        os.unlink(f.name)


ARMED = ["network_host_port", "unix_sockets", "read_service_db", "read_shadow", "read_work", "proc_snoop"]


def test_corpus_is_armed(host):
    """Without the sandbox (LOCKSTEP_SANDBOX_UNSAFE=1: rlimits only, as the unprivileged uid) the
    read-only attacks do win: a 0 above is the sandbox's doing, not a broken program's."""
    env = {**os.environ, "LOCKSTEP_SANDBOX_UNSAFE": "1"}
    with ThreadPoolExecutor(len(ARMED)) as ex:
        runs = dict(zip(ARMED, ex.map(lambda n: _cli(["--json", "--wall-s", "10"], env=env, code=host.program(
            HOSTILE / f"{n}.py") + "\nprint('RESULT', solve())\n"), ARMED)))
    for name, run in runs.items():
        verdict = json.loads(run.stdout.strip().splitlines()[-1])
        assert not verdict["sandboxed"]
        assert "RESULT 1" in verdict["stdout"], f"{name} does not win even unsandboxed: {verdict}"


# -- the grader itself ---------------------------------------------------------------------------------
def grading_attack(host: Host, name: str) -> tuple[str, Problem, str]:
    """(program, its problem, its control judge) of tests/hostile/grading/NAME.py: the tests are the
    JSON list on its `# tests:` line (every one wrong for the program), the control the judge it
    beats without the defence (`# control: naive`, else the old judge)."""
    path = HOSTILE / "grading" / f"{name}.py"
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    tests = json.loads(next(line for line in header if line.startswith("# tests: "))[len("# tests: "):])
    control = "naive" if "# control: naive" in header else "old"
    return host.program(path), Problem("Write solve().", tuple(tests), "solve"), control


@pytest.mark.parametrize("name", GRADING)
def test_grading_cannot_be_forged(host, name):
    """No test of an attack on the grading passes: the tests run in their own sandbox."""
    program, problem, _ = grading_attack(host, name)
    (out,) = _grade_all([program], problem, LIMITS)
    close_pools()
    assert out.total == len(problem.tests) >= 1
    assert out.passed == 0, f"{name}: a wrong program passed {out.passed}/{out.total} tests ({out.reason})"


@pytest.mark.parametrize("name", GRADING)
def test_grading_attack_wins_without_the_defence(host, name):
    """The control: the same program against the judge before issue 27 (the tests in the program's
    own interpreter) passes every one of its tests; against a judge trusting the exit status, the
    attacks that the old judge already stopped do."""
    program, problem, control = grading_attack(host, name)
    judge = run_tests_naive if control == "naive" else run_tests_old

    async def main():
        return await judge(program, problem, LIMITS)

    out = asyncio.run(main())
    close_pools()
    assert out.passed == out.total, f"{name}: the attack does not even win against the {control} judge: {out}"


# -- the CLI and the limits -----------------------------------------------------------------------------
def test_cli_run_json():
    require_sandbox()
    small = ["--json", "--wall-s", "3", "--cpu-s", "1", "--output-kb", "16"]
    cases = {"hello": "print('hello, sandbox')\n", "exit3": "import sys\nprint('bye')\nsys.exit(3)\n",
             "loop": "while True:\n    pass\n",
             "output": "import sys\nfor _ in range(256):\n    sys.stdout.write('x' * 8191 + '\\n')\n"}
    with ThreadPoolExecutor(len(cases)) as ex:
        runs = dict(zip(cases, ex.map(lambda c: _cli(small, code=c), cases.values())))
    verdicts = {}
    for name, run in runs.items():
        verdicts[name] = v = json.loads(run.stdout.strip().splitlines()[-1])
        assert v["sandboxed"] is True
        assert run.returncode == (0 if name == "hello" else 1), (name, run.returncode, run.stderr)
    assert verdicts["hello"]["status"] == "ok" and verdicts["hello"]["exit_code"] == 0
    assert verdicts["hello"]["stdout"] == "hello, sandbox\n"
    assert verdicts["exit3"]["status"] == "error" and verdicts["exit3"]["exit_code"] == 3
    assert verdicts["exit3"]["stdout"] == "bye\n"
    loop = verdicts["loop"]
    assert (loop["status"], loop["limit"]) in (("limit", "cpu"), ("timeout", None)), loop
    # A wall limit is a product property about time: the sandbox's own reported running time, held
    # to the 3 s it enforces plus 0.5 s for its watcher (every WATCH_S) to stop and reap the tree.
    assert loop["wall_s"] < 3.5
    out = verdicts["output"]
    assert (out["status"], out["limit"]) == ("limit", "output"), out
    assert len(out["stdout"].encode()) <= 16 << 10 < out["stdout_bytes"]


def test_limits_validation_is_clear():
    with pytest.raises(LimitsError, match=r"memory_mb: expected at least 64 \(the interpreter itself\), got 10"):
        Limits(memory_mb=10)
    with pytest.raises(LimitsError, match=r"wall_s: expected a number of seconds in \(0, 3600\], got 0"):
        Limits(wall_s=0)
    with pytest.raises(LimitsError, match=r"cpu_s: expected an integer in \[1, 3600\], got 1.5"):
        Limits(cpu_s=1.5)
    with pytest.raises(LimitsError, match=r"processes: expected an integer in \[1, 4096\], got True"):
        Limits(processes=True)
    run = _cli(["--json", "--memory-mb", "10"], code="print(1)\n")
    assert run.returncode == 2
    assert run.stderr.strip() == "error: memory_mb: expected at least 64 (the interpreter itself), got 10"
    assert "Traceback" not in run.stderr and run.stdout == ""


# -- the shipped problems ------------------------------------------------------------------------------
@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_shipped_problems_grade_right():
    """Every shipped problem's reference solution gets reward 1; wrong programs (the entry point
    returning None, or its first argument) less."""
    require_sandbox()
    rows = [json.loads(line) for line in SHIPPED.read_text().splitlines() if line.strip()]
    problems = [Problem(r["prompt"], tuple(r["tests"]), r.get("entry_point", ""), r["solution"]) for r in rows]
    assert len(problems) >= 40 and all(p.entry_point and p.solution for p in problems)
    limits = Limits(wall_s=10, cpu_s=5)

    stubs = ("def {}(*a, **k):\n    return None\n", "def {}(*a, **k):\n    return a[0] if a else None\n")

    async def main():
        good = [run_tests(p.solution, p, limits) for p in problems]
        wrong = [run_tests(s.format(p.entry_point), p, limits) for s in stubs for p in problems]
        return await asyncio.gather(*good, *wrong)

    results = asyncio.run(main())
    close_pools()
    good, stub = results[:len(problems)], results[len(problems):]
    wrong = [(p.entry_point, o) for p, o in zip(problems, good) if o.passed != o.total]
    assert not wrong, f"reference solutions not passing: {wrong}"
    assert all(o.reason == "ok" for o in good)
    passing_stubs = [(p.entry_point, o) for p, o in zip(problems * len(stubs), stub) if o.passed >= o.total]
    assert not passing_stubs, f"stubs passing every test: {passing_stubs}"
