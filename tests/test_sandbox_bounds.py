"""A sandbox bounded as a whole (issue 27, item 5): each attack in tests/hostile/ that one defence
contains, run with that defence and, as its control, without it (the attack must then win: a 0
under the defence is the defence's doing, not a broken program's).

- cgroup (sandbox/cgroup.py): socket buffers and System V message queues are memory in no
  process's resident set; a fork bomb with RLIMIT_NPROC lifted meets pids.max; an OOM kill is a
  memory verdict; the fallback without cgroups is said once and keeps the rlimits.
- seccomp: System V message queues and socket families other than AF_UNIX.
- a uid per sandbox: a sandbox starving its neighbour of a per-user kernel budget.
- python_tool's interpreter stopped between turns (cgroup v2 freezer, else SIGSTOP), and a
  stopped one still dies with its owner.
- the grader's package (the shipped problems' solutions) hidden where a tree would show it.
- the kernel check of the process limit.

Controls change one thing in this process (the cgroup set-up, the filter's rules, the uid pool,
the hidden paths), and the pools are closed around each, so that no sandbox of one kind is reused
for the other.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from required import require_sandbox

from lockstep.envs.code import SHIPPED
from lockstep.sandbox import bwrap, cgroup, process, seccomp, uids
from lockstep.sandbox.pool import Session, close_pools, run_program_blocking
from lockstep.sandbox.types import Limits, SandboxUnavailable

HOSTILE = Path(__file__).parent / "hostile"
LIMITS = Limits(wall_s=10, cpu_s=4, memory_mb=256, processes=16, open_files=64, output_kb=16, tmpfs_mb=32)
SYSV = ("msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop", "semctl")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    require_sandbox()
    close_pools()
    yield
    close_pools()
    monkeypatch.undo()
    cgroup.forget()
    seccomp.filter_bytes.cache_clear()


def has_cgroup() -> bool:
    return isinstance(cgroup.host(), cgroup.Host)


def need_cgroup() -> None:
    if not has_cgroup():
        pytest.skip(f"no cgroup for sandboxes here: {cgroup.host()}")


@pytest.fixture
def no_cgroup(monkeypatch):
    """The fallback, forced: no cgroup, whatever the host has."""
    monkeypatch.setenv(cgroup.ENV, "off")
    cgroup.forget()


def program(name: str, limits: Limits = LIMITS) -> str:
    code = (HOSTILE / f"{name}.py").read_text()
    for key, value in {"@SANDBOX_MEMORY_MB@": str(cgroup.memory_max_mb(limits)), "@SOLUTIONS@": str(SHIPPED),
                       "@SOLUTIONS_TREE@": str(SHIPPED.parents[3]), "@PROCESSES@": str(limits.processes)}.items():
        code = code.replace(key, value)
    return code


def attack(name: str, limits: Limits = LIMITS):
    """(did the attack win, the verdict) of tests/hostile/NAME.py's solve() in a fresh sandbox."""
    v = run_program_blocking(program(name, limits) + "\nprint('RESULT', solve())\n", limits)
    return "RESULT 1" in v.stdout, v


def lift_nproc(monkeypatch) -> None:
    """Launch sandboxes without RLIMIT_NPROC (the worker's own applies), so pids.max stands alone."""
    real = process._rlimits
    monkeypatch.setattr(process, "_rlimits", lambda limits: {k: v for k, v in real(limits).items()
                                                             if k != "RLIMIT_NPROC"})


def without_rules(monkeypatch, names=(), sockets=False) -> None:
    monkeypatch.setattr(seccomp, "DENIED", tuple(n for n in seccomp.DENIED if n not in names))
    if sockets:
        monkeypatch.setattr(seccomp, "SOCKET_CALLS", ())
    seccomp.filter_bytes.cache_clear()


# -- the cgroup ---------------------------------------------------------------------------------------
def test_socket_buffers_are_bounded_by_the_cgroup():
    need_cgroup()
    won, v = attack("socket_buffers")
    assert not won, v
    assert v.reason in ("ok", "memory"), v


def test_socket_buffers_control_without_a_cgroup(no_cgroup):
    won, v = attack("socket_buffers")
    assert won, f"queued less than the sandbox's memory bound even without a cgroup: {v}"


def test_message_queues_are_refused_and_bounded_by_the_cgroup_alone(monkeypatch):
    won, v = attack("sysv_msgqueue")
    assert not won and v.status == "ok", v  # msgget is EPERM: nothing queued, nothing killed
    without_rules(monkeypatch, SYSV)
    if has_cgroup():  # the kernel charges the messages to the cgroup: the filter is not the only bound
        won, v = attack("sysv_msgqueue")
        assert not won, v


def test_message_queues_control_without_filter_rule_or_cgroup(monkeypatch, no_cgroup):
    without_rules(monkeypatch, SYSV)
    won, v = attack("sysv_msgqueue")
    assert won, v


THREADS = Limits(wall_s=10, cpu_s=4, memory_mb=2048, processes=16)
"""Room for the thread bomb's 128 stacks of address space: only a process count can stop it."""


def test_the_pids_cgroup_bounds_a_thread_bomb_without_rlimit_nproc(monkeypatch):
    need_cgroup()
    lift_nproc(monkeypatch)
    won, v = attack("thread_bomb", THREADS)
    assert not won and v.ok, v


def test_thread_bomb_control_without_rlimit_nproc_or_cgroup(monkeypatch, no_cgroup):
    lift_nproc(monkeypatch)
    won, v = attack("thread_bomb", THREADS)  # it stops itself at 4 x processes + 64 threads
    assert won, v


def test_an_oom_kill_in_the_cgroup_is_a_memory_limit():
    """Memory the watch cannot see, one allocation past the bound: the kernel kills, the verdict
    names memory (not a bare SIGKILL)."""
    need_cgroup()
    code = ("import socket\npairs = []\nwhile True:\n    a, b = socket.socketpair()\n    pairs.append((a, b))\n"
            "    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 20)\n    a.setblocking(False)\n"
            "    try:\n        while True:\n            a.send(b'x' * 65536)\n    except BlockingIOError:\n"
            "        pass\n")
    limits = Limits(wall_s=10, cpu_s=4, memory_mb=64, open_files=1024, tmpfs_mb=8)
    v = run_program_blocking(code, limits)
    assert (v.status, v.limit) == ("limit", "memory"), v


def test_a_sandbox_cgroup_holds_the_limits_and_is_removed_after(monkeypatch):
    need_cgroup()
    s = Session(LIMITS)
    assert s.cell_blocking("x = 1").ok
    cg = s._sb._cgroup
    h = cgroup.host()
    mem = cgroup.memory_max_mb(LIMITS) << 20
    files = {"pids": ("pids.max", str(LIMITS.processes + 1))}
    if h.version == 2:
        files |= {"memory": ("memory.max", str(mem)), "cpu": ("cpu.max", f"{cgroup.PERIOD_US} {cgroup.PERIOD_US}")}
    else:
        files |= {"memory": ("memory.limit_in_bytes", str(mem))}
        if "cpu" in cg.dirs:
            files["cpu"] = ("cpu.cfs_quota_us", str(cgroup.PERIOD_US))
    for controller, (name, value) in files.items():
        assert (cg.dirs[controller] / name).read_text().strip() == value, (controller, name)
    init = s._sb._init_pid
    assert init in cg.procs() and len(cg.procs()) == 2  # bwrap's init and the launcher, nothing else
    s.close()
    assert not any(d.exists() for d in cg.dirs.values())


def test_the_memory_watch_never_counts_the_hosts_processes():
    """Until bwrap has moved into the sandbox's root, /proc/INIT/root/proc is the host's procfs:
    summing it gave a hello program a 'memory' verdict on a loaded machine (1 in 100 at load 12).
    Seen as from an init still in the host's root (ours), the watch counts the launcher's own
    process only."""
    s = Session(LIMITS)
    try:
        assert s.cell_blocking("x = 1").ok
        sb = s._sb
        assert 0 < sb.tree_rss() < LIMITS.memory_mb << 20
        sb._init_pid, init = os.getpid(), sb._init_pid
        assert 0 < sb.tree_rss() < LIMITS.memory_mb << 20  # the launcher's own process, not the host's /proc
        sb._init_pid = init
    finally:
        s.close()


def test_the_cli_runs_under_cgroups_and_leaves_none_behind():
    """`lockstep sandbox run` in its own process: the program runs, and once the process has
    exited no cgroup of its sandboxes is left in any hierarchy."""
    import subprocess
    import sys

    need_cgroup()
    r = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "sandbox", "run", "-", "--json"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = r.communicate("print(6 * 7)", timeout=120)
    assert r.returncode == 0 and '"stdout": "42\\n"' in out, (out, err)
    left = [d for parent in set(cgroup.host().parents.values()) if parent.is_dir()
            for d in parent.iterdir() if d.name.startswith(f"lockstep-{r.pid}-")]
    assert not left, left


def test_without_cgroups_the_fallback_is_said_once_and_keeps_the_rlimits(no_cgroup, caplog):
    with caplog.at_level(logging.WARNING, logger="lockstep.sandbox"):
        for _ in range(3):
            bwrap.check_available()
        v = run_program_blocking("print(sum(range(10)))", LIMITS)
        bomb = run_program_blocking(program("fork_bomb") + "\nprint('RESULT', solve())\n", LIMITS)
    warnings = [r.getMessage() for r in caplog.records if "without a cgroup" in r.getMessage()]
    assert len(warnings) == 1 and f"{cgroup.ENV}=off" in warnings[0], warnings
    assert v.ok and v.stdout == "45\n", v
    assert "RESULT 0" in bomb.stdout, bomb  # RLIMIT_NPROC still holds it


NOT_ROOT = """
import logging
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from lockstep.sandbox import bwrap
from lockstep.sandbox.pool import Session, run_program_blocking
from lockstep.sandbox.types import Limits
bwrap.check_available()
v = run_program_blocking("import os; print(os.getuid())", Limits())
s = Session(Limits(), pause_idle=True)
c = s.cell_blocking("x = 41")
d = s.cell_blocking("print(x + 1)")
s.close()
print("RESULT", v.status, v.stdout.strip(), c.status, d.stdout.strip())
"""


def test_not_root_runs_without_cgroup_or_uid_pool_and_says_why():
    """As an unprivileged user (uid 65534 here), where the cgroup directories are root's: one
    warning naming why, programs run, the pause falls back to signals."""
    import shutil
    import site
    import subprocess

    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root (to become another user), setpriv and /usr/bin/python3")
    path = f"{Path(bwrap.__file__).parents[2]}:{site.getsitepackages()[0]}"  # pyseccomp from this venv
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "env", f"PYTHONPATH={path}",
                        "HOME=/tmp", "/usr/bin/python3", "-c", NOT_ROOT], capture_output=True, text=True,
                       timeout=120, cwd="/")
    if "ModuleNotFoundError" in r.stderr or "Permission denied" in r.stderr and "python" in r.stderr:
        pytest.skip(f"the system python cannot load lockstep as uid 65534 here: {r.stderr[-300:]}")
    assert r.returncode == 0 and "RESULT ok 65534 ok 42" in r.stdout, (r.stdout, r.stderr)
    warnings = [line for line in r.stderr.splitlines() if "sandboxes run without a cgroup" in line]
    assert len(warnings) == 1, r.stderr


# -- seccomp ------------------------------------------------------------------------------------------
def test_socket_families_other_than_unix_are_refused():
    won, v = attack("socket_families")
    assert not won and v.ok, v


def test_socket_families_control_without_the_rule(monkeypatch):
    without_rules(monkeypatch, sockets=True)
    won, v = attack("socket_families")
    assert won, v


def test_normal_programs_still_run_under_the_filter():
    """The interpreter, asyncio's self-pipe (socketpair(AF_UNIX)), fork multiprocessing, queues."""
    code = ("import asyncio, multiprocessing, socket\n"
            "async def f():\n    return 7\n"
            "a, b = socket.socketpair()\na.send(b'x')\nassert b.recv(1) == b'x'\n"
            "with multiprocessing.get_context('fork').Pool(2) as p:\n    s = sum(p.map(abs, range(-5, 5)))\n"
            "q = multiprocessing.Queue()\nq.put(3)\nprint(asyncio.run(f()), s, q.get())\n")
    v = run_program_blocking(code, LIMITS)
    assert v.ok and v.stdout == "7 25 3\n", v


# -- a uid per sandbox ----------------------------------------------------------------------------
def _starve() -> tuple[int, bool]:
    """Instances the holder took in one sandbox, and whether another sandbox was starved."""
    instances = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    holder_limits = Limits(wall_s=10, cpu_s=4, memory_mb=256, open_files=min(65536, instances + 64))
    holder = Session(holder_limits)
    try:
        v = holder.cell_blocking(program("neighbours/inotify_starve") + "\nprint(hold())\n")
        assert v.ok, v
        won, probe = attack("neighbours/inotify_starve")
        assert probe.ok, probe
        return int(v.stdout), won
    finally:
        holder.close()


def test_a_sandbox_cannot_starve_its_neighbour_of_a_per_user_budget():
    if not uids.pooled():
        pytest.skip("not root: every sandbox runs as the caller's uid (no pool)")
    held, starved = _starve()
    assert held > 0 and not starved


def test_neighbour_control_with_one_shared_uid(monkeypatch):
    if not uids.pooled():
        pytest.skip("not root: every sandbox runs as the caller's uid (no pool)")
    monkeypatch.setattr(uids, "lease", lambda: uids.Lease(bwrap.SANDBOX_UID, -1))  # the old, shared uid
    held, starved = _starve()
    assert held > 0 and starved


def test_sandboxes_running_at_once_have_distinct_outer_uids():
    if not uids.pooled():
        pytest.skip("not root: every sandbox runs as the caller's uid (no pool)")
    sessions = [Session(LIMITS) for _ in range(3)]
    try:
        outs = [s.cell_blocking("import os\nprint(os.getuid())") for s in sessions]
        assert [o.stdout for o in outs] == [f"{bwrap.SANDBOX_UID}\n"] * 3  # the same inside
        outer = [os.stat(f"/proc/{s._sb._init_pid}").st_uid for s in sessions]
        assert len(set(outer)) == 3 and all(uids.in_pool(u) for u in outer), outer
    finally:
        for s in sessions:
            s.close()


# -- python_tool between turns ----------------------------------------------------------------------
def _task_states(init: int) -> list[str]:
    """The state of every thread in the sandbox, read from its own procfs (independent of how the
    supervisor finds its processes)."""
    base, states = f"/proc/{init}/root/proc", []
    for pid in (p for p in os.listdir(base) if p.isdigit()):
        try:
            tids = os.listdir(f"{base}/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                states.append(Path(f"{base}/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                pass
    return states


def _between_turns(pause_idle: bool) -> list[str]:
    s = Session(LIMITS, pause_idle=pause_idle)
    try:
        v = s.cell_blocking(program("sessions/background_work"))
        assert v.ok and v.stdout == "left running\n", v
        states = _task_states(s._sb._init_pid)
        again = s.cell_blocking("print(SPUN)")  # the interpreter goes on where it was
        assert again.ok and again.stdout == "kept\n", again
        return states
    finally:
        s.close()


@pytest.mark.parametrize("mode", ["cgroup", "signals"])
def test_an_idle_interpreter_runs_nothing_between_turns(mode, monkeypatch):
    if mode == "cgroup":  # v2: its freezer; v1: SIGSTOP to the processes its cgroup lists
        need_cgroup()
    else:
        monkeypatch.setenv(cgroup.ENV, "off")
        cgroup.forget()
    states = _between_turns(pause_idle=True)
    assert len(states) >= 4, states  # init, the launcher and its thread, the double-forked spinner
    assert "R" not in states, states
    frozen = mode == "cgroup" and cgroup.host().version == 2
    assert set(states) <= ({"D", "T", "t", "S"} if frozen else {"T", "t"}), states


OWNER = """
import sys
from lockstep.sandbox.pool import Session
from lockstep.sandbox.types import Limits
s = Session(Limits(wall_s=10, cpu_s=4, memory_mb=256), pause_idle=True)
assert s.cell_blocking("x = 1").ok
print(s._sb._init_pid, flush=True)
sys.stdin.read()  # holds the paused sandbox until it is killed
"""


@pytest.mark.parametrize("mode", ["cgroup", "signals"])
def test_a_paused_sandbox_dies_with_its_owner(mode):
    """An env worker killed between two turns leaves no sandbox behind, paused or not (a cgroup
    v1 freezer kept 12 frozen for good after a killed test run: SIGKILL waits for a thaw there)."""
    import select
    import subprocess
    import sys

    env = dict(os.environ)
    if mode == "cgroup":
        need_cgroup()
    else:
        env[cgroup.ENV] = "off"
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        init = int(owner.stdout.readline())
        gone = os.pidfd_open(init)  # readable once the sandbox's first process has ended
    finally:
        owner.kill()
        owner.wait()
    try:
        assert select.select([gone], [], [], 60)[0], "the paused sandbox outlived its owner"
    finally:
        os.close(gone)


def test_between_turns_control_without_the_pause():
    states = _between_turns(pause_idle=False)
    assert states.count("R") >= 2, states  # the thread and the spinner, unwatched


def test_the_tool_env_stops_its_interpreter_between_turns(builtin_dir):
    """Through the env itself: after a turn whose cell left work running, nothing of it runs."""
    import asyncio

    from transformers import AutoTokenizer

    from lockstep.envs.python_tool import Problem, PythonToolEnv

    tok = AutoTokenizer.from_pretrained(builtin_dir)
    env = PythonToolEnv((1, 2), Problem("q", "42"), tok, max_tokens=64, max_turns=4, limits=LIMITS)
    code = program("sessions/background_work")
    assert tok.decode(tok.encode(code), skip_special_tokens=True) == code

    async def turn():
        return await env.step(tok.encode(f"<python>{code}</python>"))

    try:
        r = asyncio.run(turn())
        assert not r.episode_done and env._session.started
        states = _task_states(env._session._sb._init_pid)
        assert len(states) >= 4 and "R" not in states, states
    finally:
        env.close()


# -- the grader's data -------------------------------------------------------------------------------
def show_the_package(monkeypatch) -> None:
    """As on a host where lockstep is installed under a tree the sandbox sees (a Python in /usr/local
    or /opt): the directory that holds the imported package is bound read-only too."""
    monkeypatch.setattr(bwrap, "TREES", bwrap.TREES + (str(SHIPPED.parents[3]),))


def test_the_graders_solutions_are_hidden(monkeypatch):
    won, v = attack("read_solutions")  # as this host is: the package is not under a visible tree
    assert not won and v.ok, v
    show_the_package(monkeypatch)
    assert str(SHIPPED.parents[2]) in bwrap.hidden_paths(bwrap._trees())
    won, v = attack("read_solutions")
    assert not won and v.ok, v


def test_solutions_control_without_hiding(monkeypatch):
    show_the_package(monkeypatch)
    monkeypatch.setattr(bwrap, "hidden_paths", lambda trees: [])
    won, v = attack("read_solutions")
    assert won, v


# -- the kernel check ----------------------------------------------------------------------------------
def test_the_process_limit_is_refused_where_it_would_not_be_the_sandboxs_own(monkeypatch, no_cgroup):
    monkeypatch.setattr(bwrap, "kernel_version", lambda: (5, 13))
    monkeypatch.setattr(uids, "pooled", lambda: False)
    problem = bwrap.process_limit_problem()
    assert "Linux 5.13 counts RLIMIT_NPROC over every process of uid" in problem
    assert "Linux >= 5.14" in problem and cgroup.ENV in problem
    with pytest.raises(SandboxUnavailable, match="untrusted code is refused: the sandbox's process limit"):
        bwrap.check_available()
    monkeypatch.setattr(bwrap, "kernel_version", lambda: (5, 14))
    assert bwrap.process_limit_problem() == ""
    monkeypatch.setattr(bwrap, "kernel_version", lambda: (5, 13))
    monkeypatch.setattr(uids, "pooled", lambda: True)  # a uid per sandbox: its count is its own
    assert bwrap.process_limit_problem() == ""


def test_a_pids_cgroup_makes_any_kernel_fine(monkeypatch):
    need_cgroup()
    monkeypatch.setattr(bwrap, "kernel_version", lambda: (4, 19))
    monkeypatch.setattr(uids, "pooled", lambda: False)
    assert bwrap.process_limit_problem() == ""


def test_cgroup_paths_under_mounts_of_a_subtree():
    """/proc/self/cgroup paths map onto mounts whose root is a subtree (a container's bind mount
    or cgroup namespace), and a path outside the mounted subtree maps to none."""
    assert cgroup._join("/sys/fs/cgroup", "/", "/a/b") == Path("/sys/fs/cgroup/a/b")
    assert cgroup._join("/sys/fs/cgroup", "/", "/") == Path("/sys/fs/cgroup")
    assert cgroup._join("/sys/fs/cgroup/memory", "/docker/x", "/docker/x/y") == Path("/sys/fs/cgroup/memory/y")
    assert cgroup._join("/sys/fs/cgroup/memory", "/docker/x", "/docker/x") == Path("/sys/fs/cgroup/memory")
    assert cgroup._join("/sys/fs/cgroup/memory", "/docker/x", "/docker/xy") is None
    assert cgroup.memory_max_mb(Limits(memory_mb=512, tmpfs_mb=64)) == 512 + 64 + 8 + 64
