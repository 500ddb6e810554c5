"""End to end: K tinker SDK clients, each its own LoRA on one base, against a live service, before
and after issue 28 (a shared base per worker, packed batches).

    PYTHONPATH=src .venv/bin/python -u bench/multi_tenant_e2e.py --before-src /tmp/before-src/src \
        --before-kernels /tmp/before-kernels [--clients 16] [--rounds 8] [--segments 2] [--json out.json]

BEFORE is the code before issue 28 (extract it: `git archive 8fa86ef src | tar -x -C /tmp/before-src`;
its fused kernels have another build tag, so build them once into their own directory:
`LOCKSTEP_KERNELS_DIR=/tmp/before-kernels PYTHONPATH=/tmp/before-src/src python -m lockstep.engine.kernels`).
AFTER is this checkout's src (with this process's LOCKSTEP_KERNELS_DIR). The service is the real
thing: `lockstep serve --no-worker` and one `lockstep worker` as subprocesses (tests/service_harness.py),
with the worker's defaults, run with the mode's PYTHONPATH; the clients are the installed tinker SDK,
the same script for both modes.

Clients are spread round-robin over --tenants tenants (16: each its own). Each has one LoRA training client (rank 16, the SDK's other defaults:
attention, MLP and lm_head) and one sampling client on its first snapshot. A round is, in order
and each awaited: forward_backward (4 datums x 32 tokens, cross_entropy), optim_step (AdamW), and
sample (a 16-token prompt, 4 samples x 16 new tokens, no stop). After a warm-up round, the clients
start together and each runs --rounds rounds; a segment's wall time runs from that start to the
last client's last result. The modes alternate by segment (BEFORE, AFTER, BEFORE, AFTER, ...),
each segment on a freshly started service (the tenants' database is kept per mode), so the
machine's load hits both alike. Latency: from the SDK call to its result, per call kind, over all
segments of a mode. RSS: the worker and its Executor (where the models live), sampled every second.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from common import machine
from service_harness import Service, alive, wait_until

BASE = "lockstep/tiny"
RANK = 16
FB_ROWS, FB_TOKENS = 4, 32
PROMPT, SAMPLES, NEW = 16, 4, 16
KINDS = ("forward_backward", "optim_step", "sample")


class Client:
    """One tenant's SDK clients and its round of calls, timing each call kind."""

    def __init__(self, url: str, key: str, seed: int):
        import tinker

        self.tc = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(
            base_model=BASE, rank=RANK, seed=seed).result()
        self.sampler = self.tc.save_weights_and_get_sampling_client().result()
        self.vocab = min(self.tc.get_tokenizer().vocab_size, 256)
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        self.latency: dict[str, list[float]] = {k: [] for k in KINDS}

    def _datums(self) -> list:
        from tinker import types

        out = []
        for _ in range(FB_ROWS):
            toks = self.rng.integers(4, self.vocab, FB_TOKENS + 1).tolist()
            out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={
                "target_tokens": np.asarray(toks[1:], np.int64), "weights": np.ones(FB_TOKENS, np.float32)}))
        return out

    def _timed(self, kind: str, call) -> None:
        t = time.perf_counter()
        call().result()
        self.latency[kind].append(time.perf_counter() - t)

    def round(self) -> None:
        from tinker import types

        data = self._datums()
        prompt = types.ModelInput.from_ints(self.rng.integers(4, self.vocab, PROMPT).tolist())
        params = types.SamplingParams(max_tokens=NEW, temperature=1.0, stop=[], seed=int(self.rng.integers(1 << 30)))
        self._timed("forward_backward", lambda: self.tc.forward_backward(data, "cross_entropy"))
        self._timed("optim_step", lambda: self.tc.optim_step(types.AdamParams(learning_rate=1e-4)))
        self._timed("sample", lambda: self.sampler.sample(prompt=prompt, num_samples=SAMPLES, sampling_params=params))


class PatientService(Service):
    """The harness's service with the waits a loaded machine needs, and the worker started again
    when Ray's node fails its fixed 30 s startup wait (seen at load average 40)."""

    def start(self) -> PatientService:
        self.api = self._spawn("serve", "--no-worker", "--port", str(self.port))
        wait_until(self._api_up, timeout=900, what="the API", every=1)
        for _ in range(8):
            self.start_worker()
            if wait_until(lambda: self.executor() or self.worker.poll() is not None, timeout=1200,
                          what="the worker's executor", every=1) is not True:
                return self
        raise RuntimeError(f"the worker did not start (see {self.log})")


class RssProbe:
    """Resident sets every second, until stopped: (the worker's process tree, with Ray's own
    processes; the Executor alone, which holds the models)."""

    def __init__(self, svc: Service):
        self.svc, self.samples, self.stop = svc, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                procs = [psutil.Process(self.svc.worker.pid), *psutil.Process(self.svc.worker.pid).children(recursive=True)]
                ex = self.svc.executor()
                self.samples.append((sum(p.memory_info().rss for p in alive(procs)), ex.memory_info().rss if ex else 0))
            except psutil.NoSuchProcess:
                pass
            self.stop.wait(1.0)

    def done(self) -> list[tuple[int, int]]:
        self.stop.set()
        self.thread.join()
        return self.samples


def tenants(svc: Service, home: Path, n: int) -> list[str]:
    """n tenants' API keys, made once per mode's database (each `tenants create` is a process)."""
    keys_file = home / "keys.json"
    if keys_file.exists():
        return json.loads(keys_file.read_text())
    keys = [svc.tenant(f"e2e{i}", max_models=64) for i in range(n)]  # clients share them round-robin
    keys_file.write_text(json.dumps(keys))
    return keys


def segment(mode: str, env: dict, home: Path, clients: int, rounds: int, n_tenants: int) -> dict:
    load_before = os.getloadavg()
    svc = PatientService(home, env=env)
    try:
        svc.start()
        keys = tenants(svc, home, n_tenants)
        made, errors = [None] * clients, []
        start, ready = threading.Event(), threading.Barrier(clients + 1)
        finished = [0.0] * clients

        def run(i: int) -> None:
            try:
                made[i] = c = Client(svc.url, keys[i % len(keys)], seed=i)
                c.round()  # warm-up: first requests, model builds, kernel loads
                c.latency = {k: [] for k in KINDS}
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(f"client {i} setup: {type(e).__name__}: {e}")
            ready.wait()
            start.wait()
            try:
                for _ in range(rounds if made[i] else 0):
                    made[i].round()
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(f"client {i}: {type(e).__name__}: {e}")
            finished[i] = time.perf_counter()

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        ready.wait()
        probe = RssProbe(svc)
        t0 = time.perf_counter()
        start.set()
        for t in threads:
            t.join()
        wall = max(finished) - t0
        rss = probe.done()
    finally:
        svc.stop()
    lat = {k: [x for c in made if c for x in c.latency[k]] for k in KINDS}
    out = {"mode": mode, "clients": clients, "tenants": n_tenants, "rounds": rounds, "wall_s": round(wall, 2),
           "rounds_per_s": round(rounds / wall, 4), "client_rounds_per_s": round(clients * rounds / wall, 3),
           "worker_rss_mib_peak": round(max(r[0] for r in rss) / 2**20) if rss else None,
           "executor_rss_mib_peak": round(max(r[1] for r in rss) / 2**20) if rss else None,
           "executor_rss_mib_end": round(rss[-1][1] / 2**20) if rss else None,
           "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
           "errors": errors[:5], "n_errors": len(errors), "latency": lat}
    pcts = {f"{k}_p{q}_s": round(float(np.percentile(v, q)), 3) for k, v in lat.items() if v for q in (50, 99)}
    print(json.dumps({**{k: v for k, v in out.items() if k != "latency"}, **pcts}), flush=True)  # lands if a later segment is cut
    return out


def summary(segs: list[dict]) -> dict:
    lat = {k: [x for s in segs for x in s["latency"][k]] for k in KINDS}
    wall, rounds = sum(s["wall_s"] for s in segs), sum(s["rounds"] for s in segs)
    return {"mode": segs[0]["mode"], "segments": len(segs), "rounds": rounds, "wall_s": round(wall, 2),
            "rounds_per_s": round(rounds / wall, 4), "client_rounds_per_s": round(segs[0]["clients"] * rounds / wall, 3),
            "worker_rss_mib_peak": max(s["worker_rss_mib_peak"] for s in segs),
            "executor_rss_mib_peak": max(s["executor_rss_mib_peak"] for s in segs),
            "errors": sum(s["n_errors"] for s in segs),
            **{f"{k}_p50_s": round(float(np.percentile(v, 50)), 3) for k, v in lat.items() if v},
            **{f"{k}_p99_s": round(float(np.percentile(v, 99)), 3) for k, v in lat.items() if v},
            "calls_per_kind": len(lat["sample"])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before-src", required=True, help="src/ of the code before issue 28 (commit 8fa86ef)")
    ap.add_argument("--before-kernels", required=True, help="LOCKSTEP_KERNELS_DIR with that code's kernels built")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tenants", type=int, default=16, help="clients are spread over this many tenants")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds per client per segment")
    ap.add_argument("--segments", type=int, default=2, help="segments per mode, alternating")
    ap.add_argument("--modes", default="before,after")
    ap.add_argument("--json")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the service (finally)
    after_kernels = os.environ.get("LOCKSTEP_KERNELS_DIR", str(ROOT / "src/lockstep/engine/kernels/_build"))
    envs = {"before": {"PYTHONPATH": args.before_src, "LOCKSTEP_KERNELS_DIR": args.before_kernels},
            "after": {"PYTHONPATH": str(ROOT / "src"), "LOCKSTEP_KERNELS_DIR": after_kernels}}
    for mode, env in envs.items():  # each mode's service must import its own code
        where = subprocess.run([sys.executable, "-c", "import lockstep; print(lockstep.__file__)"], env={**os.environ, **env},
                               capture_output=True, text=True, check=True).stdout.strip()
        assert where.startswith(env["PYTHONPATH"]), (mode, where)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    root = Path(tempfile.mkdtemp(prefix="lockstep-e2e-"))
    modes = args.modes.split(",")
    segs = {m: [] for m in modes}
    for _ in range(args.segments):
        for m in modes:
            segs[m].append(segment(m, envs[m], root / m, args.clients, args.rounds, args.tenants))
    report = {"machine": machine(), "started": started,
              "summary": [summary(segs[m]) for m in modes], "segments": [s for m in modes for s in segs[m]]}
    for s in report["summary"]:
        print(json.dumps(s), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if any(s["errors"] for s in report["summary"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
