"""One sandboxed interpreter: a bwrap process tree running the launcher, and calls into it.

The supervisor side trusts only what the program cannot forge: its own wall clock, the bytes it
read, the tree's memory as the kernel reports it, and exit statuses. The launcher's answer only
labels a failure. Every call returns a Verdict; a call never raises for anything the program does.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import selectors
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from pathlib import Path

from lockstep.sandbox import cgroup, pause, uids
from lockstep.sandbox.bwrap import bwrap_command, check_available, interpreter, spawn_user, unsafe
from lockstep.sandbox.seccomp import filter_fd
from lockstep.sandbox.types import Limits, SandboxError, Verdict

LAUNCHER = (Path(__file__).parent / "launcher.py").read_text()
MAX_CODE_BYTES = 1 << 20
"""Largest program or cell accepted (a model's completion is far smaller)."""
CPU_HARD_FACTOR = 64
"""A process's hard CPU limit is this many calls' worth: each call gets `cpu_s` more (soft), and
the wall clock bounds every call anyway."""
WATCH_S = 0.05
"""How often the tree's resident memory is checked while a call runs."""
EXIT_GRACE_S = 2.0
"""How long a program that answered is given to exit before it is killed."""
START_S = 30.0
"""How long bwrap may take to make the sandbox's namespaces (milliseconds, normally)."""

ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
       "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
"""The program's whole environment (nothing of the host's: no tokens, no paths). A fixed hash
seed, so that a replayed interpreter iterates sets and dicts of strings the same way."""


def _rlimits(limits: Limits) -> dict[str, tuple[int, int]]:
    mem = limits.memory_mb << 20
    return {"RLIMIT_CPU": (limits.cpu_s + 1, limits.cpu_s * CPU_HARD_FACTOR + 1), "RLIMIT_AS": (mem, mem),
            "RLIMIT_NPROC": (limits.processes, limits.processes),
            "RLIMIT_FSIZE": (limits.file_size_mb << 20, limits.file_size_mb << 20),
            "RLIMIT_NOFILE": (limits.open_files, limits.open_files), "RLIMIT_CORE": (0, 0)}


class Sandbox:
    """A started sandbox; the launcher in it waits for code. Not thread-safe: one call at a time."""

    def __init__(self, limits: Limits):
        check_available()
        self.limits, self.sandboxed, self.calls, self.paused = limits, not unsafe(), 0, False
        self._tmp = self._cgroup = self._lease = self._init_pid = None
        self._status = self._oom_seen = 0
        try:
            self._lease = uids.lease() if uids.pooled() else None
            self._cgroup = cgroup.create(limits) if self.sandboxed else None
            self._spawn()
        except BaseException:
            if getattr(self, "proc", None) is not None:
                self.proc.stdout.close()
                self.proc.stderr.close()
            self._release()
            raise
        for fd in (self.proc.stdout.fileno(), self.proc.stderr.fileno(), self._ctl_out):
            os.set_blocking(fd, False)
        self.started = time.monotonic()

    def _spawn(self) -> None:
        """Start bwrap; with a cgroup, its first process joins it before it forks anything (bwrap
        waits on --block-fd after making the namespaces, before it forks the launcher)."""
        uid = self._lease.uid if self._lease is not None else None
        ctl_in_r, self._ctl_in = os.pipe()
        self._ctl_out, ctl_out_w = os.pipe()
        cwd, ours, theirs = "/tmp", [], [ctl_in_r, ctl_out_w]
        if not self.sandboxed:  # the operator's explicit choice: rlimits and timers only
            self._tmp = cwd = tempfile.mkdtemp(prefix="lockstep-unsafe-")
            if uid is not None:
                os.chown(cwd, uid, uid)
        cfg = {"in": ctl_in_r, "out": ctl_out_w, "rlimits": _rlimits(self.limits), "cwd": cwd,
               "reap": self.sandboxed}
        cmd = argv = [interpreter(), "-s", "-B", "-c", LAUNCHER, json.dumps(cfg)]
        env = dict(ENV, HOME=cwd)
        if self.sandboxed:
            info_r, info_w = os.pipe()
            block_r, block_w = os.pipe()
            ours += [info_r, block_w]
            theirs += [info_w, block_r, filter_fd()]
            cmd = bwrap_command(argv, tmpfs_mb=self.limits.tmpfs_mb, env=env, seccomp_fd=theirs[-1],
                                pooled_uid=uid is not None)
            cmd[1:1] = ["--info-fd", str(info_w), "--block-fd", str(block_r)]
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, pass_fds=tuple(theirs), cwd="/", env=env,
                                         start_new_session=True, **spawn_user(uid))
        except OSError as e:
            _close(*ours, self._ctl_in, self._ctl_out)
            raise SandboxError(f"could not start a sandbox: {e}") from None
        finally:
            _close(*theirs)
        if self.sandboxed:
            self._admit(*ours)

    def _admit(self, info_r: int, block_w: int) -> None:
        """Learn the sandbox's init from bwrap, put it in the cgroup, then let it go on. Whatever
        fails, the sandbox never runs outside its cgroup: it is killed before it is let go."""
        try:
            self._init_pid = _child_pid(info_r)
            if self._cgroup is not None:
                if self._init_pid is None:
                    raise SandboxError("bwrap exited before it made the sandbox: " + self._stderr_tail())
                self._cgroup.add(self._init_pid)
        except (OSError, SandboxError) as e:
            self._kill()
            _close(block_w, self._ctl_in, self._ctl_out)
            raise SandboxError(f"could not start a sandbox: {e}") from None
        finally:
            _close(info_r)
        try:
            os.write(block_w, b"go")
        except OSError:
            pass  # bwrap died: the first call sees it
        _close(block_w)

    def _stderr_tail(self) -> str:
        self.proc.wait()
        return self.proc.stderr.read().decode("utf-8", "replace").strip()[-300:]

    def _release(self) -> None:
        """The cgroup and the uid, once every process of the sandbox is dead."""
        if self._cgroup is not None:
            self._cgroup.remove()
            self._cgroup = None
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    # -- state -------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and self.proc.poll() is None

    def close(self) -> None:
        """Kill the whole tree and release everything (idempotent)."""
        if self.proc.returncode is None:
            self._kill()
        _close(self._ctl_in, self._ctl_out)
        self._ctl_in = self._ctl_out = -1
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self._release()

    def __del__(self):  # a dropped sandbox must not outlive its owner
        try:
            if self.proc.returncode is None:
                self._kill()
            self._release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _kill(self) -> tuple[int, float]:
        """SIGKILL the tree; returns (wait status, CPU seconds of everything reaped)."""
        if self._cgroup is not None and self._cgroup.frozen:
            try:
                self._cgroup.thaw()  # not needed for SIGKILL on v2, but leaves nothing frozen behind
            except OSError:
                pass  # remove() kills what is left
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # bwrap; its PID namespace dies with its init
        except ProcessLookupError:
            pass
        return self._reap()

    def _reap(self) -> tuple[int, float]:
        if self.proc.returncode is not None:
            return self._status, 0.0
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self._status = status
        if not self.sandboxed:  # the launcher's group may have left children behind
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return status, usage.ru_utime + usage.ru_stime

    # -- memory ------------------------------------------------------------------------------
    def tree_rss(self) -> int:
        """Resident bytes of every process in the sandbox (0 when they cannot be read)."""
        page, total = resource.getpagesize(), 0
        init = self._init_pid
        if init is not None and not self._pivoted(init):
            init = None  # bwrap reports its init before pivot_root: /proc/INIT/root/proc is still the host's
        if init is None:  # the launcher's own process only, never the machine's
            pids, base = [str(self.proc.pid)], "/proc"
        else:  # the sandbox's own procfs lists exactly its processes
            base = f"/proc/{init}/root/proc"
            try:
                pids = [p for p in os.listdir(base) if p.isdigit()]
            except OSError:
                return 0
        for pid in pids:
            try:
                with open(f"{base}/{pid}/statm", "rb") as f:
                    total += int(f.read().split()[1]) * page
            except (OSError, ValueError, IndexError):
                pass
        return total

    @staticmethod
    def _pivoted(init: int) -> bool:
        """Whether the sandbox's init has its own root yet."""
        try:
            root, ours = os.stat(f"/proc/{init}/root"), os.stat("/")
        except OSError:
            return False
        return (root.st_dev, root.st_ino) != (ours.st_dev, ours.st_ino)

    # -- between calls ---------------------------------------------------------------------
    def pause(self) -> None:
        """Stop every process of the sandbox until the next call: between two tool calls nothing
        watches it, so nothing of it runs (its cgroup v2 frozen, else each process SIGSTOPped). A
        sandbox that cannot be held still is killed rather than left running."""
        if not self.sandboxed or self.paused or not self.alive or self._init_pid is None:
            return
        self.paused = True
        try:
            if self._cgroup is not None and self._cgroup.can_freeze:
                held = self._cgroup.freeze()
            else:
                held = pause.stop(self._members())
        except OSError:
            held = False
        if not held:
            self._kill()

    def _members(self) -> pause.Members:
        """The sandbox's processes: its cgroup's list, else its PID namespace's."""
        if self._cgroup is not None:
            return self._cgroup.procs
        return pause.namespace_members(self._init_pid)

    def _resume(self) -> None:
        if not self.paused:
            return
        self.paused = False
        try:
            if self._cgroup is not None and self._cgroup.frozen:
                self._cgroup.thaw()
            elif self.alive:
                pause.resume(self._members())
        except OSError:
            self._kill()  # a sandbox that cannot be woken is not half-used: the call sees it exited

    def _oom_killed(self) -> bool:
        """Whether the kernel OOM-killed a process of the sandbox since the last look."""
        if self._cgroup is None:
            return False
        seen, self._oom_seen = self._oom_seen, self._cgroup.oom_kills()
        return self._oom_seen > seen

    # -- calls -------------------------------------------------------------------------------
    def call(self, code: str, *, mode: str = "cell", name: str = "<program>") -> Verdict:
        """Run `code` ("program": as __main__, then the sandbox exits; "cell": in the kept namespace).
        Blocks for at most about `limits.wall_s`."""
        lim, t0 = self.limits, time.monotonic()
        self._resume()
        if not self.alive:
            return Verdict("error", error="the sandbox's interpreter has exited", sandboxed=self.sandboxed)
        data = code.encode("utf-8", "replace")
        if len(data) > MAX_CODE_BYTES:
            return Verdict("error", error=f"program of {len(data)} bytes refused (at most {MAX_CODE_BYTES})",
                           sandboxed=self.sandboxed)
        self.calls += 1
        rid = secrets.token_hex(8)
        body = json.dumps({"id": rid, "code": code, "mode": mode, "cpu_s": lim.cpu_s, "name": name}).encode()
        pending = struct.pack(">I", len(body)) + body
        cap = lim.output_kb << 10
        out = {"stdout": bytearray(), "stderr": bytearray()}
        counts = {"stdout": 0, "stderr": 0}
        answer, ctl = None, bytearray()
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout.fileno(), selectors.EVENT_READ, "stdout")
        sel.register(self.proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
        sel.register(self._ctl_out, selectors.EVENT_READ, "ctl")
        os.set_blocking(self._ctl_in, False)
        sel.register(self._ctl_in, selectors.EVENT_WRITE, "in")
        verdict_kind, next_watch, launcher_gone = None, t0 + WATCH_S, False
        try:
            while answer is None and verdict_kind is None:
                now = time.monotonic()
                if now >= t0 + lim.wall_s:
                    verdict_kind = ("timeout", None)
                    break
                if now >= next_watch:
                    next_watch = now + WATCH_S
                    if self.tree_rss() > lim.memory_mb << 20:
                        verdict_kind = ("limit", "memory")
                        break
                for key, _ in sel.select(timeout=min(WATCH_S, t0 + lim.wall_s - now)):
                    what = key.data
                    if what == "in":
                        try:
                            pending = pending[os.write(self._ctl_in, pending):]
                        except BrokenPipeError:
                            pending = b""
                        if not pending:
                            sel.unregister(self._ctl_in)
                        continue
                    chunk = self._read(key.fd)
                    if chunk is None:
                        continue
                    if not chunk:
                        sel.unregister(key.fd)
                        if what == "ctl":
                            launcher_gone = True
                        continue
                    if what == "ctl":
                        ctl += chunk
                        answer = _frame(ctl)
                        if answer is not None and answer.get("id", rid) != rid:
                            answer = {"status": "error", "error": "the sandbox answered another request"}
                        continue
                    counts[what] += len(chunk)
                    room = cap - len(out[what])
                    out[what] += chunk[:max(room, 0)]
                    if counts[what] > cap:
                        verdict_kind = ("limit", "output")
                if launcher_gone and answer is None:
                    break
        finally:
            sel.close()
        # Output the program wrote before it answered is already in the pipes: take it.
        for what, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            while counts[what] <= cap:
                chunk = self._read(stream.fileno())
                if not chunk:
                    break
                counts[what] += len(chunk)
                out[what] += chunk[:max(cap - len(out[what]), 0)]
            if counts[what] > cap and verdict_kind is None and answer is None:
                verdict_kind = ("limit", "output")
        return self._verdict(answer, verdict_kind, mode, out, counts, t0)

    @staticmethod
    def _read(fd: int) -> bytes | None:
        try:
            return os.read(fd, 65536)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _verdict(self, answer, verdict_kind, mode, out, counts, t0) -> Verdict:
        text = {k: bytes(v).decode("utf-8", "replace") for k, v in out.items()}
        common = dict(stdout=text["stdout"], stderr=text["stderr"], stdout_bytes=counts["stdout"],
                      stderr_bytes=counts["stderr"], sandboxed=self.sandboxed)
        if self._oom_killed():  # the kernel's bound on the whole cgroup: the tree went over its memory
            verdict_kind = ("limit", "memory")
        if verdict_kind is not None:  # our own timer, memory watch or output cap: kill the tree
            _, cpu = self._kill()
            status, limit = verdict_kind
            return Verdict(status, limit=limit, wall_s=time.monotonic() - t0, cpu_s=cpu, **common)
        if answer is not None and answer.get("status") in ("ok", "error", "limit"):
            cpu = max(0.0, float(answer.get("cpu_s") or 0.0))
            exit_code = answer.get("exit_code") if mode == "program" else None
            if mode == "program":  # it exits by itself; its status is the truth, not its answer
                status_word, _ = self._wait_exit()
                exit_code = os.waitstatus_to_exitcode(status_word) if os.WIFEXITED(status_word) else None
                if exit_code is None:
                    return self._died(status_word, cpu, t0, common)
            status = answer["status"]
            if mode == "program" and exit_code != 0 and status == "ok":
                status = "error"
            limit = answer.get("limit") if status == "limit" else None
            return Verdict(status, exit_code=exit_code, limit=limit, error=str(answer.get("error") or "")[:1000],
                           wall_s=time.monotonic() - t0, cpu_s=cpu, **common)
        # No answer: the interpreter died (a signal, os._exit, a crash) or closed its control pipe.
        status_word, cpu = self._wait_exit()
        verdict = self._died(status_word, cpu, t0, common)
        if mode == "cell" and verdict.ok:  # os._exit(0) mid-cell: the cell did not finish, so never a pass
            return Verdict("error", exit_code=verdict.exit_code, error="the interpreter exited during the call",
                           wall_s=verdict.wall_s, cpu_s=verdict.cpu_s, **common)
        return verdict

    def _wait_exit(self) -> tuple[int, float]:
        deadline = time.monotonic() + EXIT_GRACE_S
        while time.monotonic() < deadline:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                self._status = status
                if not self.sandboxed:  # children it left in its process group (unsafe mode has no PID namespace)
                    try:
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                return status, usage.ru_utime + usage.ru_stime
            time.sleep(0.005)
        return self._kill()

    def _died(self, status_word: int, cpu: float, t0: float, common: dict) -> Verdict:
        wall = time.monotonic() - t0
        if os.WIFSIGNALED(status_word):
            sig = os.WTERMSIG(status_word)
        else:
            code = os.WEXITSTATUS(status_word)
            # bwrap reports a child killed by signal N as exit 128 + N.
            sig = code - 128 if self.sandboxed and code > 128 else None
            if sig is None:
                status = "ok" if code == 0 else "error"
                return Verdict(status, exit_code=code, error="" if code == 0 else f"exited with status {code}",
                               wall_s=wall, cpu_s=cpu, **common)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= self.limits.cpu_s):
            return Verdict("limit", signal=sig, limit="cpu", wall_s=wall, cpu_s=cpu, **common)
        if sig == signal.SIGXFSZ:
            return Verdict("limit", signal=sig, limit="file_size", wall_s=wall, cpu_s=cpu, **common)
        return Verdict("error", signal=sig, error=f"killed by signal {signal.Signals(sig).name}"
                       if sig in signal.valid_signals() else f"killed by signal {sig}", wall_s=wall, cpu_s=cpu, **common)


def _frame(buf: bytearray) -> dict | None:
    """The launcher's answer once a whole frame has arrived (a malformed one counts as none)."""
    if len(buf) < 4:
        return None
    (n,) = struct.unpack(">I", bytes(buf[:4]))
    if n > 1 << 20:
        return {"status": "error", "error": "malformed answer from the sandbox"}
    if len(buf) < 4 + n:
        return None
    try:
        obj = json.loads(bytes(buf[4:4 + n]))
    except ValueError:
        return {"status": "error", "error": "malformed answer from the sandbox"}
    return obj if isinstance(obj, dict) else {"status": "error", "error": "malformed answer from the sandbox"}


def _close(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None and fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def _child_pid(info_r: int) -> int | None:
    """The host pid of the sandbox's first process, from bwrap's --info-fd (None if bwrap exited
    first). bwrap writes it once, then every copy of the pipe is closed."""
    data, deadline = b"", time.monotonic() + START_S
    with selectors.DefaultSelector() as sel:
        sel.register(info_r, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            chunk = os.read(info_r, 4096)
            if not chunk:
                break
            data += chunk
        else:
            raise SandboxError(f"bwrap did not make the sandbox within {START_S:.0f} s")
    try:
        return int(json.loads(data)["child-pid"]) if data else None
    except (ValueError, KeyError, TypeError):
        return None
