"""Ready sandboxes, and the async API that envs use.

Starting a sandbox (bwrap, namespaces, an interpreter) costs ~15-25 ms; a pool per set of limits
keeps a few started, so that a short program costs little more than its own run. A sandbox is
used by one program (or one episode's interpreter) and then destroyed: nothing a program leaves
behind reaches the next one. Calls block on pipes, so they run in this module's thread pool;
`MAX_RUNNING` of them run at once per process, so a burst of programs shares the CPUs instead of
all timing out together (their wall clocks start when they run).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from lockstep.sandbox import cgroup
from lockstep.sandbox.bwrap import unsafe
from lockstep.sandbox.process import Sandbox
from lockstep.sandbox.types import Limits, SandboxError, Verdict

READY = 4
"""Started sandboxes kept per set of limits."""
MAX_RUNNING = max(4, 2 * (os.cpu_count() or 1))
"""Programs running at once in one process."""

_executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="sandbox")
_running = threading.BoundedSemaphore(MAX_RUNNING)


class SandboxPool:
    """Started sandboxes with one set of limits, refilled in the background."""

    def __init__(self, limits: Limits, ready: int = READY, prime: str = ""):
        self.limits, self.ready, self.prime = limits, ready, prime
        self._idle: deque[Sandbox] = deque()
        self._lock = threading.Condition()  # a lock; notified when a refill ends (close(wait=True))
        self._filling = self.closed = False
        self.started = self.taken = 0

    def take(self) -> Sandbox:
        """A started sandbox (from the pool when one is ready)."""
        sb = None
        with self._lock:
            while self._idle and sb is None:
                candidate = self._idle.popleft()
                if candidate.alive:
                    sb = candidate
                else:
                    candidate.close()
        self.taken += 1
        self._refill()
        return sb or self._start()

    def _start(self) -> Sandbox:
        self.started += 1
        sb = Sandbox(self.limits)
        if self.prime:  # our own code, in a sandbox no program has used yet (sandbox/grading.py)
            verdict = sb.call(self.prime, mode="cell")
            if not verdict.ok:
                sb.close()
                raise SandboxError(f"a sandbox could not be primed: {verdict.reason} {verdict.error}")
        return sb

    def _refill(self) -> None:
        with self._lock:
            if self.closed or self._filling or len(self._idle) >= self.ready:
                return
            self._filling = True
        _executor.submit(self._fill)

    def _fill(self) -> None:
        try:
            while True:
                with self._lock:
                    if self.closed or len(self._idle) >= self.ready:
                        return
                try:
                    sb = self._start()
                except SandboxError:
                    return
                with self._lock:
                    if self.closed:  # closed while this one started
                        sb.close()
                        return
                    self._idle.append(sb)
        finally:
            with self._lock:
                self._filling = False
                self._lock.notify_all()

    def close(self, *, wait: bool = False) -> None:
        """Stop refilling and destroy the idle sandboxes (take() still works, unpooled). wait: also
        until a refill under way has ended (the sandbox it was starting is closed by then), for
        callers that count the processes left, as tests do."""
        with self._lock:
            self.closed = True
            idle, self._idle = list(self._idle), deque()
            if wait:
                self._lock.wait_for(lambda: not self._filling)
        for sb in idle:
            sb.close()


_pools: dict[tuple[Limits, bool, str, str], SandboxPool] = {}
_pools_lock = threading.Lock()


def pool(limits: Limits, prime: str = "") -> SandboxPool:
    """The pool of sandboxes with these limits, made the way this process makes them now (an
    operator's LOCKSTEP_SANDBOX_UNSAFE and the cgroup set-up are part of the key: a pooled sandbox
    is never of the other kind). `prime`: a cell each sandbox runs when started, before it is
    handed out (trusted code only)."""
    key = (limits, unsafe(), str(cgroup.host()), prime)
    with _pools_lock:
        if key not in _pools:
            _pools[key] = SandboxPool(limits, prime=prime)
        return _pools[key]


@atexit.register
def close_pools(*, wait: bool = False) -> None:
    """Close every pool of this process (idle sandboxes destroyed, no more refills; `wait`: see
    SandboxPool.close)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for p in pools:
        p.close(wait=wait)


def _call(sb: Sandbox, code: str, mode: str, name: str) -> Verdict:
    with _running:
        return sb.call(code, mode=mode, name=name)


def run_program_blocking(code: str, limits: Limits, *, name: str = "<program>") -> Verdict:
    """Run one program in a fresh sandbox and destroy it."""
    sb = pool(limits).take()
    try:
        return _call(sb, code, "program", name)
    finally:
        sb.close()


async def run_program(code: str, limits: Limits, *, name: str = "<program>") -> Verdict:
    return await asyncio.get_running_loop().run_in_executor(_executor, run_program_blocking, code, limits, name)


class Session:
    """One episode's interpreter: cells share a namespace. A cell that times out or hits a limit
    kills the interpreter; the owner decides whether to restart it (the tool env replays)."""

    def __init__(self, limits: Limits, prime: str = "", *, pause_idle: bool = False):
        self.limits, self.prime, self.pause_idle = limits, prime, pause_idle
        """pause_idle: stop the interpreter's processes between cells (Sandbox.pause), for owners
        that leave it idle for long (the tool env, while the model writes its next turn)."""
        self._sb: Sandbox | None = None

    @property
    def started(self) -> bool:
        return self._sb is not None and self._sb.alive

    def cell_blocking(self, code: str) -> Verdict:
        if self._sb is None or not self._sb.alive:
            self.close()
            self._sb = pool(self.limits, self.prime).take()
        verdict = _call(self._sb, code, "cell", "<cell>")
        if self.pause_idle:
            self._sb.pause()
        return verdict

    async def cell(self, code: str) -> Verdict:
        return await asyncio.get_running_loop().run_in_executor(_executor, self.cell_blocking, code)

    def close(self) -> None:
        if self._sb is not None:
            self._sb.close()
            self._sb = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
