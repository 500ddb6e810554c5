"""lockstep's bubblewrap sandbox as tinker-cookbook's sandbox backends.

- `LockstepSandbox`: the cookbook's `SandboxInterface` (tinker_cookbook/sandbox/sandbox_interface.py:
  sandbox_id, send_heartbeat, run_command, read_file, write_file, cleanup) on one kept sandboxed
  interpreter (pool.Session). Its private tmpfs /tmp is the only writable place and the default
  working directory; every limit of `Limits` holds for the whole sandbox.
- `fusion_app`: the SandboxFusion HTTP route (`POST /run_code`) that the cookbook's `code_rl`
  recipe calls by default (its `SandboxFusionClient`, pointed here with `SANDBOX_URL`), each request
  in a fresh `LockstepSandbox`, so that recipe runs unchanged with no Docker container.

Everything a caller sends (commands, paths, file contents, timeouts) runs or is interpreted inside
the sandbox; the host only builds a cell from base64/JSON literals, never from the caller's text.
"""


import asyncio
import base64
import binascii
import json
import re
import secrets
from typing import Any

from lockstep.sandbox.pool import Session
from lockstep.sandbox.process import MAX_CODE_BYTES
from lockstep.sandbox.types import Limits

DEFAULT_LIMITS = Limits(wall_s=120.0, cpu_s=60, memory_mb=1024, processes=64, output_kb=1024, tmpfs_mb=256)
"""A cookbook episode runs shell commands (an interpreter plus its children), so more processes, a
bigger /tmp and more output than the single-program default; each stays an operator's choice."""
DEFAULT_OUTPUT_BYTES = 128 << 10
"""run_command's stdout/stderr cap when the caller gives none (the interface's documented 128 KB)."""
MAX_FILE_BYTES = (MAX_CODE_BYTES // 4) * 3 - (4 << 10)
"""Largest write_file content: it travels base64-encoded inside one cell of at most MAX_CODE_BYTES."""
EXIT_TIMEOUT = 124
"""run_command's exit code when its timeout killed the command (as coreutils' `timeout`)."""

# The cells. Each runs in the sandbox's interpreter; the caller's values arrive as one JSON literal
# (json.dumps of str/int/None is a valid Python literal only through json.loads, so it is decoded
# there), and the cell prints one JSON line back.
_RUN = """def _lockstep_run(a):
    import json, os, signal, subprocess
    out_path, err_path = '/tmp/.lockstep-out', '/tmp/.lockstep-err'
    with open(out_path, 'wb') as out, open(err_path, 'wb') as err:
        p = subprocess.Popen(['/bin/sh', '-c', a['command']], cwd=a['workdir'], stdin=subprocess.DEVNULL,
                             stdout=out, stderr=err, start_new_session=True)
        try:
            code = p.wait(timeout=a['timeout'])
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            code = %(timeout_code)d
    def head(path):
        with open(path, 'rb') as f:
            data = f.read(a['cap'] + 1)
        os.unlink(path)
        return data[:a['cap']].decode('utf-8', 'replace'), len(data) > a['cap']
    (o, o_cut), (e, e_cut) = head(out_path), head(err_path)
    print(json.dumps({'exit_code': code, 'stdout': o, 'stderr': e, 'truncated': o_cut or e_cut}))
_lockstep_run(__import__('json').loads(%(args)s))
"""
_READ = """def _lockstep_read(a):
    import base64, json
    try:
        with open(a['path'], 'rb') as f:
            data = f.read(a['cap'] + 1)
    except OSError as e:
        print(json.dumps({'exit_code': 1, 'stderr': f'{type(e).__name__}: {e}'}))
        return
    if a['limit'] is None and len(data) > a['cap']:
        print(json.dumps({'exit_code': 1, 'stderr': f"{a['path']}: larger than {a['cap']} bytes; pass max_bytes"}))
        return
    print(json.dumps({'exit_code': 0, 'data': base64.b64encode(data[:a['cap']]).decode()}))
_lockstep_read(__import__('json').loads(%(args)s))
"""
_WRITE = """def _lockstep_write(a):
    import base64, json, os
    try:
        parent = os.path.dirname(a['path'])
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(a['path'], 'wb') as f:
            f.write(base64.b64decode(a['data']))
        if a['executable']:
            os.chmod(a['path'], 0o755)
    except OSError as e:
        print(json.dumps({'exit_code': 1, 'stderr': f'{type(e).__name__}: {e}'}))
        return
    print(json.dumps({'exit_code': 0}))
_lockstep_write(__import__('json').loads(%(args)s))
"""


def _result(exit_code: int, stdout: str = "", stderr: str = "", **metrics):
    from tinker_cookbook.sandbox import SandboxResult  # the cookbook is optional for lockstep

    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code, metrics=metrics)


def _terminated(message: str):
    from tinker_cookbook.sandbox import SandboxTerminatedError

    return SandboxTerminatedError(message)


class LockstepSandbox:
    """One sandbox (bubblewrap, seccomp, rlimits, cgroup where the host has one) for one episode.
    Calls are serialised: the interpreter runs one cell at a time. A call that hits a limit kills
    the sandbox; later calls raise the cookbook's SandboxTerminatedError."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS):
        self.limits = limits
        self._id = "lockstep-" + secrets.token_hex(8)
        self._session = Session(limits)
        self._lock = asyncio.Lock()
        self._dead = ""

    @classmethod
    async def create(cls, limits: Limits = DEFAULT_LIMITS) -> "LockstepSandbox":
        """A started sandbox (starting one is a few ms to a second, off the event loop)."""
        sb = cls(limits)
        await sb.send_heartbeat()
        return sb

    @property
    def sandbox_id(self) -> str:
        return self._id

    async def send_heartbeat(self, timeout: int = 30) -> None:
        """Starts the interpreter if it is not yet; raises SandboxTerminatedError if it died."""
        await self._cell("None", timeout=timeout)

    async def run_command(self, command: str, workdir: str | None = None, timeout: int = 60,
                          max_output_bytes: int | None = None):
        cap = DEFAULT_OUTPUT_BYTES if max_output_bytes is None else max_output_bytes
        if not isinstance(command, str) or not command:
            raise ValueError("run_command: command must be a non-empty shell command string")
        budget = self._output_budget()
        if not isinstance(cap, int) or not 0 <= cap <= budget:
            raise ValueError(f"run_command: max_output_bytes must be an integer in [0, {budget}] "
                             f"(the sandbox's output_kb={self.limits.output_kb}), got {max_output_bytes!r}")
        wait = self._command_seconds(timeout)
        ans = await self._cell(_RUN % {"args": _literal({"command": command, "workdir": workdir or "/tmp",
                                                         "timeout": wait, "cap": cap}),
                                       "timeout_code": EXIT_TIMEOUT}, timeout=timeout)
        return _result(ans["exit_code"], ans["stdout"], ans["stderr"], truncated=ans["truncated"],
                       timed_out=ans["exit_code"] == EXIT_TIMEOUT)

    async def read_file(self, path: str, max_bytes: int | None = None, timeout: int = 60):
        budget = self._output_budget()
        if max_bytes is not None and (not isinstance(max_bytes, int) or not 0 <= max_bytes <= budget):
            raise ValueError(f"read_file: max_bytes must be an integer in [0, {budget}], got {max_bytes!r}")
        ans = await self._cell(_READ % {"args": _literal({"path": _path(path), "limit": max_bytes,
                                                          "cap": budget if max_bytes is None else max_bytes})},
                               timeout=timeout)
        if ans["exit_code"]:
            return _result(ans["exit_code"], stderr=ans["stderr"])
        return _result(0, base64.b64decode(ans["data"]).decode("utf-8", "replace"))

    async def write_file(self, path: str, content: str | bytes, executable: bool = False, timeout: int = 60):
        data = content.encode("utf-8") if isinstance(content, str) else content
        if not isinstance(data, bytes):
            raise ValueError(f"write_file: content must be str or bytes, got {type(content).__name__}")
        if len(data) > MAX_FILE_BYTES:
            raise ValueError(f"write_file: {len(data)} bytes is over the {MAX_FILE_BYTES}-byte cap of one "
                             "write; write the file in parts (e.g. run_command with `cat >>`)")
        ans = await self._cell(_WRITE % {"args": _literal({"path": _path(path), "executable": bool(executable),
                                                           "data": base64.b64encode(data).decode()})},
                               timeout=timeout)
        return _result(ans["exit_code"], stderr=ans.get("stderr", ""))

    async def cleanup(self) -> None:
        async with self._lock:
            self._dead = self._dead or "cleaned up"
            await asyncio.to_thread(self._session.close)

    def _output_budget(self) -> int:
        """Bytes of file data one answer can carry: the cell's stdout (output_kb) holds it as JSON,
        base64 or escaped text, at most ~2x the raw size with both streams; leave room for that."""
        return max(0, ((self.limits.output_kb << 10) - 4096) // 3)

    def _command_seconds(self, timeout) -> float:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        # The sandbox's own wall clock (limits.wall_s) bounds every call; the command gets what is
        # left after the interpreter's bookkeeping, so a slow command ends as a timeout (exit 124),
        # not as a killed sandbox.
        return float(min(timeout, max(self.limits.wall_s - 2.0, 0.5)))

    async def _cell(self, code: str, *, timeout) -> dict:
        self._command_seconds(timeout)  # validates it
        async with self._lock:
            if self._dead:
                raise _terminated(f"sandbox {self._id} is gone: {self._dead}")
            verdict = await self._session.cell(code)
            if not verdict.ok:
                self._dead = f"{verdict.reason}: {verdict.error or verdict.stderr[-500:]}"
                await asyncio.to_thread(self._session.close)
                raise _terminated(f"sandbox {self._id} died: {self._dead}")
        lines = verdict.stdout.strip().splitlines()
        return json.loads(lines[-1]) if lines else {}


def _literal(args: dict) -> str:
    """A Python string literal of args' JSON: repr of a str is always a valid, inert literal."""
    return repr(json.dumps(args))


def _path(path) -> str:
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"path must be a non-empty string without NUL bytes, got {path!r}")
    return path


# --- SandboxFusion's /run_code, for code_rl's default backend --------------------------------------

FILE_NAME = re.compile(r"^(?!/)(?!.*(^|/)\.\.(/|$))[\w.\-/]{1,200}$")
"""A file the request ships: a relative path under the sandbox's work directory, no '..'."""


def fusion_app(limits: Limits = DEFAULT_LIMITS, *, max_concurrency: int = 4, max_files: int = 64):
    """A FastAPI app answering SandboxFusion's `POST /run_code` (the fields SandboxFusionClient
    sends: code, language, run_timeout, files as base64) from fresh LockstepSandboxes, at most
    `max_concurrency` at once. Bad requests get a 400 naming the field; the program's own failure
    is a 200 with status "Failed", as SandboxFusion answers."""
    from fastapi import FastAPI, HTTPException, Request

    app = FastAPI(title="lockstep sandbox (SandboxFusion-compatible)")
    gate = asyncio.Semaphore(max_concurrency)

    @app.post("/run_code")
    async def run_code(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
            code, files, run_timeout = _fusion_request(body, limits, max_files)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        async with gate:
            return await _fusion_run(code, files, run_timeout, limits)

    return app


def _fusion_request(body, limits: Limits, max_files: int) -> tuple[str, dict[str, bytes], float]:
    if not isinstance(body, dict):
        raise ValueError("body: expected a JSON object with code, language, run_timeout, files")
    code, language = body.get("code"), body.get("language", "python")
    if not isinstance(code, str) or len(code.encode()) > MAX_FILE_BYTES:
        raise ValueError(f"code: expected a string of at most {MAX_FILE_BYTES} bytes")
    if language != "python":
        raise ValueError(f"language: only 'python' is served here, got {language!r}")
    run_timeout = body.get("run_timeout", 10)
    if isinstance(run_timeout, bool) or not isinstance(run_timeout, (int, float)) or not 0 < run_timeout <= limits.wall_s:
        raise ValueError(f"run_timeout: expected seconds in (0, {limits.wall_s}] (the sandbox's wall_s), "
                         f"got {run_timeout!r}")
    raw = body.get("files") or {}
    if not isinstance(raw, dict) or len(raw) > max_files:
        raise ValueError(f"files: expected an object of at most {max_files} name -> base64 content")
    files = {}
    for name, b64 in raw.items():
        if not FILE_NAME.match(name) or name == "main.py":
            raise ValueError(f"files: {name!r} is not a relative file name (letters, digits, . _ - /, no '..')")
        try:
            files[name] = base64.b64decode(b64, validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise ValueError(f"files[{name!r}]: not valid base64") from None
    if sum(map(len, files.values())) > MAX_FILE_BYTES * 4:
        raise ValueError(f"files: more than {MAX_FILE_BYTES * 4} bytes in all")
    return code, files, float(run_timeout)


async def _fusion_run(code: str, files: dict[str, bytes], run_timeout: float, limits: Limits) -> dict[str, Any]:
    from tinker_cookbook.sandbox import SandboxTerminatedError

    sb = LockstepSandbox(limits)
    try:
        for name, data in {**files, "main.py": code.encode()}.items():
            wrote = await sb.write_file(f"/tmp/work/{name}", data)
            if wrote.exit_code:
                return {"status": "SandboxError", "message": f"could not write {name}: {wrote.stderr}"}
        res = await sb.run_command("python3 main.py", workdir="/tmp/work", timeout=run_timeout)
    except SandboxTerminatedError as e:
        return {"status": "Failed", "message": str(e),
                "run_result": {"status": "Error", "return_code": None, "stdout": "", "stderr": str(e)}}
    finally:
        await sb.cleanup()
    timed_out = res.exit_code == EXIT_TIMEOUT and res.metrics.get("timed_out")
    return {"status": "Success" if res.exit_code == 0 else "Failed", "message": "", "compile_result": None,
            "run_result": {"status": "TimeLimitExceeded" if timed_out else "Finished", "return_code": res.exit_code,
                           "stdout": res.stdout, "stderr": res.stderr}}
