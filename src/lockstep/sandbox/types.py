"""The sandbox's contract: the limits a program runs under and the verdict on one run.

Torch-free and stdlib-only: the config layer, the envs, the job service and the CLI all use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Status = Literal["ok", "error", "timeout", "limit"]
"""ok: exited 0 (a cell: ran without an exception); error: a nonzero exit or an exception;
timeout: the wall clock ran out and the whole process tree was killed; limit: a resource limit
stopped it (`Verdict.limit` says which)."""

LIMIT_NAMES = ("cpu", "memory", "processes", "file_size", "open_files", "output")


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program in it)."""


class SandboxUnavailable(SandboxError):
    """No sandbox can be created on this machine; the message says why and what to do. Untrusted
    code is then refused, never run unsandboxed (unless the operator set LOCKSTEP_SANDBOX_UNSAFE)."""


class LimitsError(ValueError):
    """An invalid limit: the message names it and what is expected."""


@dataclass(frozen=True)
class Limits:
    """What one sandboxed program (or one episode's interpreter) may use. A table `[env.sandbox]`
    in a run config; the job service caps each value (see service/policy.py)."""

    wall_s: float = 10.0
    """Wall-clock seconds for one program (one tool call); then the whole process tree is killed."""
    cpu_s: int = 5
    """CPU seconds per process for one program or tool call (RLIMIT_CPU; SIGXCPU, then SIGKILL)."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS), and the resident memory of the whole tree, which is
    watched while a program runs (a tree over it is killed). Where the host has cgroups, the
    kernel also bounds the sandbox's whole memory, kernel memory included, at this + tmpfs_mb +
    72 MiB (sandbox/cgroup.py: memory_max_mb); over it, the verdict is limit "memory"."""
    processes: int = 32
    """Processes and threads of the sandbox (RLIMIT_NPROC, counted per sandbox: see
    bwrap.process_limit_problem; and its cgroup's pids.max where it has one)."""
    file_size_mb: int = 16
    """Largest file a program may write (RLIMIT_FSIZE)."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    output_kb: int = 64
    """stdout and stderr are each kept up to this; a program that writes more is stopped (limit)."""
    tmpfs_mb: int = 64
    """Size of the sandbox's private, writable /tmp (its only writable place)."""

    def __post_init__(self) -> None:
        def need(name: str, ok: bool, expected: str) -> None:
            if not ok:
                raise LimitsError(f"{name}: expected {expected}, got {getattr(self, name)!r}")

        need("wall_s", isinstance(self.wall_s, (int, float)) and not isinstance(self.wall_s, bool)
             and math.isfinite(self.wall_s) and 0 < self.wall_s <= 3600, "a number of seconds in (0, 3600]")
        for name, hi in (("cpu_s", 3600), ("memory_mb", 65536), ("processes", 4096), ("file_size_mb", 65536),
                         ("open_files", 65536), ("output_kb", 65536), ("tmpfs_mb", 65536)):
            v = getattr(self, name)
            need(name, isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= hi, f"an integer in [1, {hi}]")
        # The interpreter needs a few descriptors and some address space of its own.
        need("open_files", self.open_files >= 16, "at least 16 (the interpreter's own files)")
        need("memory_mb", self.memory_mb >= 64, "at least 64 (the interpreter itself)")


@dataclass(frozen=True)
class Verdict:
    """The outcome of one program or one tool call."""

    status: Status
    exit_code: int | None = None
    """The program's exit status (None when it was killed by a signal or is an interpreter cell)."""
    signal: int | None = None
    """The signal that ended it, if one did."""
    limit: str | None = None
    """With status "limit": which one (one of LIMIT_NAMES)."""
    error: str = ""
    """With status "error": the exception's type and message (or why the sandbox failed)."""
    stdout: str = ""
    stderr: str = ""
    """Output, each capped at Limits.output_kb (decoded as UTF-8 with replacement)."""
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    """Bytes the program wrote (up to the cap, past which it is stopped)."""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    sandboxed: bool = True
    """False only when the operator set LOCKSTEP_SANDBOX_UNSAFE."""
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def reason(self) -> str:
        """One word for metrics: ok, error, timeout, or the limit's name."""
        return self.limit if self.status == "limit" and self.limit else self.status

    def to_json(self) -> dict:
        return {"status": self.status, "exit_code": self.exit_code, "signal": self.signal, "limit": self.limit,
                "error": self.error, "stdout": self.stdout, "stderr": self.stderr,
                "stdout_bytes": self.stdout_bytes, "stderr_bytes": self.stderr_bytes,
                "wall_s": round(self.wall_s, 4), "cpu_s": round(self.cpu_s, 4), "sandboxed": self.sandboxed}


@dataclass(frozen=True)
class Graded:
    """What a program's tests gave (sandbox/grading.py: the tests run in a sandbox of their own)."""

    passed: tuple[bool, ...]
    """Per test, in order: whether it passed."""
    reason: str
    """ok (every test passed), failed (some failed), or what stopped the grading: timeout, violation
    (a sandbox limit), crash (an interpreter died or the program raised at load), missing_entry_point."""
    details: tuple[str, ...] = ()
    """Per test: why it failed ('' when it passed), for logs and tests."""
