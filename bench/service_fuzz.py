"""Fuzzing a live `lockstep serve` (the API and its worker, on SQLite): schemathesis over every
operation of the OpenAPI schema (/api/v1 and /v1, positive and negative cases) and hypothesis-built
hostile protobuf forward_backward bodies, aimed in part at real objects (tests/service_fuzzing.py);
then the official SDK's normal session (create a model, forward_backward, optim_step) on the same
server.

    .venv/bin/python bench/service_fuzz.py [--cases 10000] [--protobuf 3000]

Prints the cases, the statuses by code, the 5xx-or-hang count and the time; exits 1 on any 5xx,
hang or failed session.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import emit  # noqa: E402
from helpers import free_port  # noqa: E402
from service_fuzzing import Fuzzer, make_objects, normal_session  # noqa: E402

HANG_S = 60.0
"""Over the server's 25 s long-poll of a pending future, under the SDK's own 45 s + margin."""


def start_server(home: Path) -> tuple[subprocess.Popen, str, dict]:
    port = free_port()
    env = {**os.environ, "LOCKSTEP_HOME": str(home), "TINKER_TELEMETRY": "0", "PYTHONWARNINGS": "ignore"}
    db = f"sqlite:///{home / 'db.sqlite'}"
    keys = {}
    for name in ("a", "b"):
        out = subprocess.run([sys.executable, "-m", "lockstep.cli", "tenants", "create", name, "--db", db, "--json"],
                             check=True, capture_output=True, text=True, env=env).stdout
        keys[name] = json.loads(out.strip().splitlines()[-1])["api_key"]
    log = open(home / "serve.log", "w")  # noqa: SIM115 - the server's lifetime
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", "--port", str(port), "--db", db,
                             "--storage", str(home / "storage")], env=env, start_new_session=True, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(900):
        try:
            if httpx.get(f"{url}/v1/health", timeout=1).json()["base_models"] >= 1:
                return proc, url, keys
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"lockstep serve did not come up; see {home / 'serve.log'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=10_000, help="cases in all")
    ap.add_argument("--protobuf", type=int, default=3_000, help="of which protobuf forward_backward bodies")
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="lockstep-fuzz-"))
    proc, url, keys = start_server(home)
    try:
        fuzzer = Fuzzer(url, keys, make_objects(url, keys["a"]), timeout_s=HANG_S)
        fuzzer.schema_cases(a.cases - a.protobuf, fail_fast=False)
        fuzzer.protobuf_cases(a.protobuf, fail_fast=False)
        losses = normal_session(url, keys["a"])
        alive = proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    summary = fuzzer.tally.summary()
    row = {"cases": summary["cases"], "5xx_or_hang": summary["5xx_or_hang"], "seconds": summary["seconds"],
           **{f"http_{k}": v for k, v in summary["statuses"].items()},
           "session_ok": alive and losses[-1] < losses[0]}
    emit("service_fuzz", [row], {"failures": [repr(f)[:500] for f in fuzzer.tally.failures[:50]],
                                 "session_losses": losses})
    if summary["5xx_or_hang"] or not row["session_ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
