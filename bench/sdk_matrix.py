"""The tinker SDK version matrix: bench/sdk_session.py run by every tinker minor version, each in
its own venv, against one real `lockstep serve` (subprocess, built-in model).

    python bench/sdk_matrix.py                            # every minor 0.25-0.38, its latest patch
    python bench/sdk_matrix.py --versions 0.25.0,0.38.0 --also 0.24.1 --json out.json --markdown out.md

The versions come from the package index (`pip index versions tinker`): the latest patch of each
minor from --first to --last. Each gets a venv under --cache (default ~/.cache/lockstep/sdk-venvs/
<version>, made with `python -m venv` and `pip install tinker==<version>` with its own dependencies
(never this environment's packages), reused once complete). Each version's session runs as its own
tenant, so listings see only its runs. --also adds versions outside the range (0.24.1: the refusal at create_session). The result is
a table, version | passed | what failed (first error) | seconds, as JSON and markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from packaging.version import InvalidVersion, Version

SESSION = Path(__file__).with_name("sdk_session.py")
DEFAULT_CACHE = Path.home() / ".cache" / "lockstep" / "sdk-venvs"


class IndexUnreachable(RuntimeError):
    """The package index could not list tinker's versions (no network): nothing can be installed."""


@dataclass(frozen=True)
class Row:
    version: str
    """The tinker version the session ran with."""
    passed: bool
    """Every step of the session passed."""
    failed: str
    """The first failed step and its error ('' when passed)."""
    seconds: float
    """The session's wall time (the venv's creation not counted)."""
    warnings: list
    """What the SDK logged at WARNING (a create_session warning_message among them)."""
    steps: list
    """Each step: name, ok, error, seconds."""


# -- versions and venvs --------------------------------------------------------------------------
def index_versions(pip: list[str]) -> list[Version]:
    """Every tinker version the package index serves (pip's own client, whatever index it is set to)."""
    out = subprocess.run([*pip, "index", "versions", "tinker"], capture_output=True, text=True, timeout=300, check=False)
    found = re.search(r"Available versions: (.+)", out.stdout)
    if out.returncode != 0 or not found:
        raise IndexUnreachable(f"`pip index versions tinker` failed: {(out.stderr or out.stdout).strip()[-500:]}")
    versions = []
    for v in found.group(1).split(","):
        try:
            versions.append(Version(v.strip()))
        except InvalidVersion:
            continue
    return versions


def latest_patches(versions: list[Version], first: Version, last: Version) -> list[Version]:
    """The newest final release of each minor in [first, last]'s minors."""
    best: dict[tuple[int, int], Version] = {}
    for v in versions:
        minor = v.release[:2]
        if v.is_prerelease or v.is_devrelease or not first.release[:2] <= minor <= last.release[:2]:
            continue
        if minor not in best or v > best[minor]:
            best[minor] = v
    return [best[m] for m in sorted(best)]


def venv_ready(cache: Path, version: str) -> bool:
    return (cache / version / ".installed").exists()


def ensure_venv(cache: Path, version: str) -> Path:
    """<cache>/<version> with tinker==version and its dependencies; made once, marked complete last."""
    venv = cache / version
    python = venv / "bin" / "python"
    if venv_ready(cache, version):
        return python
    shutil.rmtree(venv, ignore_errors=True)  # a half-made one from an interrupted run
    cache.mkdir(parents=True, exist_ok=True)
    # No pip of its own (ensurepip is slow): this pip installs into it. No .pyc compiled up front
    # either (transformers' thousands of files took most of an install); imports compile what they use.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=600)
    log = cache / f"{version}.log"
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-compile",
                               f"tinker=={version}"], stdout=f, stderr=subprocess.STDOUT, timeout=1800, check=False)
    if done.returncode != 0:  # the index answered a listing (or did before): a real failure, not a skip
        raise RuntimeError(f"pip install tinker=={version} failed (log: {log}): "
                               f"{log.read_text().strip()[-500:]}")
    (venv / ".installed").touch()
    return python


# -- the server ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`lockstep serve` with its worker in a temporary home, the built-in model only."""

    def __init__(self, home: Path):
        self.home, self.url = home, f"http://127.0.0.1:{free_port()}"
        self.db = f"sqlite:///{home / 'db.sqlite'}"
        self.env = {**os.environ, "LOCKSTEP_HOME": str(home), "TINKER_TELEMETRY": "0", "PYTHONWARNINGS": "ignore"}
        self.proc: subprocess.Popen | None = None

    def tenant(self, name: str) -> str:
        out = subprocess.run([sys.executable, "-m", "lockstep.cli", "tenants", "create", name, "--db", self.db,
                              "--json"], check=True, capture_output=True, text=True, env=self.env).stdout
        return json.loads(out.strip().splitlines()[-1])["api_key"]

    def start(self, log: Path) -> None:
        port = self.url.rsplit(":", 1)[1]
        with open(log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", "--port", port, "--db",
                                          self.db, "--storage", str(self.home / "storage")], env=self.env,
                                         start_new_session=True, stdout=f, stderr=subprocess.STDOUT)
        while self.proc.poll() is None:  # up, with its worker's built-in model registered
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=5).json().get("base_models", 0) >= 1:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"lockstep serve exited with {self.proc.returncode}; its log: {log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# -- the matrix ----------------------------------------------------------------------------------
def run_session(python: Path, server: Server, version: str, timeout_s: float) -> Row:
    key = server.tenant(f"sdk-{version}")
    out = server.home / f"session-{version}.json"
    start = time.monotonic()
    try:
        done = subprocess.run([str(python), str(SESSION), "--base-url", server.url, "--api-key", key, "--out",
                               str(out)], capture_output=True, text=True, env=server.env, timeout=timeout_s,
                              check=False)
        tail = (done.stderr or done.stdout).strip()[-500:]
    except subprocess.TimeoutExpired:
        tail = f"the session did not finish in {timeout_s:.0f} s"
    seconds = round(time.monotonic() - start, 1)
    if not out.exists():
        return Row(version, False, f"no result: {tail}", seconds, [], [])
    result = json.loads(out.read_text())
    failed = next((f"{s['step']}: {s['error']}" for s in result["steps"] if not s["ok"]), "")
    assert result["sdk_version"] == version, (result["sdk_version"], version)  # the venv holds what it says
    return Row(version, result["passed"], failed, seconds, result["warnings"], result["steps"])


def run_matrix(versions: list[str], *, cache: Path, timeout_s: float, log=print) -> list[Row]:
    pythons = {}
    for v in versions:  # every venv first: an unreachable index fails before the server starts
        log(f"venv for tinker {v}")
        pythons[v] = ensure_venv(cache, v)
    home = Path(tempfile.mkdtemp(prefix="lockstep-sdk-matrix-"))
    server = Server(home)
    rows = []
    try:
        server.start(home / "serve.log")
        for v in versions:
            rows.append(run_session(pythons[v], server, v, timeout_s))
            r = rows[-1]
            log(f"tinker {v}: {'passed' if r.passed else 'FAILED ' + r.failed} ({r.seconds} s)")
    finally:
        server.stop()
    shutil.rmtree(home, ignore_errors=True)
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| tinker | passed | what failed (first error) | seconds |", "|---|---|---|---|"]
    for r in rows:
        failed = r.failed.replace("|", "\\|").replace("\n", " ") or "—"
        lines.append(f"| {r.version} | {'yes' if r.passed else 'no'} | {failed} | {r.seconds:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", help="comma-separated tinker versions (default: the index's, --first to --last)")
    ap.add_argument("--first", default="0.25", help="first minor when listing the index")
    ap.add_argument("--last", default="0.38", help="last minor when listing the index")
    ap.add_argument("--also", default="", help="comma-separated versions to add (e.g. 0.24.1, refused)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the per-version venvs live")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one version's session may take")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--markdown", type=Path, help="write the table here")
    a = ap.parse_args()
    if a.versions:
        versions = [v.strip() for v in a.versions.split(",") if v.strip()]
    else:
        found = index_versions([sys.executable, "-m", "pip"])
        versions = [str(v) for v in latest_patches(found, Version(a.first), Version(a.last))]
    versions = [v.strip() for v in a.also.split(",") if v.strip()] + versions
    rows = run_matrix(versions, cache=a.cache, timeout_s=a.timeout)
    if a.json:
        a.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    table = markdown(rows)
    if a.markdown:
        a.markdown.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
