"""A run across two Ray nodes started with `ray start` on this machine, one of them killed mid-run.

`lockstep run rollout.replicas=2 train.replicas=2 runtime.placement=spread`: the head node
(`ray start --head`) runs the two trainer processes, the worker node (`ray start --address=...`)
the two generator replicas and the env worker. Killing every
process of the worker node after two RL steps leaves the run to finish on the head node: Ray
restarts the lost actors there (soft node affinity), the batch they held is replayed, the ledger
shows every group trained once, and the final weights are bit for bit those of the same run on
one node, uninterrupted.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
from helpers import free_port
from safetensors.numpy import load_file

from lockstep.runtime.ledger import audit

RAY = str(Path(sys.executable).with_name("ray"))
TAG = "LOCKSTEP_TEST_NODE"
STAGE = ("stages=[{kind = 'rl', steps = 8, prompts_per_step = 4, group_size = 4, eval_every = 100, "
         "learning_rate = 3e-4, max_seconds = 0, target_accuracy = 0.0, max_staleness = 0}]")


def overrides(model) -> list[str]:
    return [STAGE, "env.num_heldout=8", "env.pass_k=0", "runtime.checkpoint_every=0", "seed=11", "rollout.replicas=2", "train.replicas=2",
            "runtime.cpus=2", f"model.path='{model}'"]


def routable_ip() -> str:
    """This machine's address on its network (as Ray picks it: the source address of a route
    out; no packet is sent). Ray's multi-node mode refuses loopback-only nodes on one machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere, only used to pick the interface
        return s.getsockname()[0]


def node_processes(tag: str) -> list:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TAG) == tag:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return out


def kill_node(tag: str) -> int:
    """SIGKILL every process of one node (its raylet, agents and workers), until none is left."""
    killed = 0
    for _ in range(20):
        procs = node_processes(tag)
        if not procs:
            break
        for p in procs:
            try:
                p.kill()
                killed += 1
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=2)
    return killed


@pytest.fixture
def two_nodes(tmp_path):
    """A head and a worker node on this machine, each with 2 logical CPUs and its own processes."""
    ip = routable_ip()
    run_id, port = uuid.uuid4().hex[:8], free_port(ip)
    temp = tempfile.mkdtemp(prefix="ray2n-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # multi-node (raylocal turns it off)
           "RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4",  # a lost node in ~2 s
           "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "disabled"}  # a test cluster on this machine alone (a worker node has no token)
    env.pop("RAY_ADDRESS", None)
    common = [f"--node-ip-address={ip}", "--num-cpus=2", "--disable-usage-stats"]
    tags = {"head": f"{run_id}-head", "worker": f"{run_id}-worker"}
    try:
        started = subprocess.run([RAY, "start", "--head", f"--port={port}", "--include-dashboard=false", *common,
                                  f"--temp-dir={temp}"], env={**env, TAG: tags["head"]}, capture_output=True,
                                 text=True, timeout=120)
        assert started.returncode == 0, started.stdout + started.stderr
        started = subprocess.run([RAY, "start", f"--address={ip}:{port}", *common], env={**env, TAG: tags["worker"]},
                                 capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stdout + started.stderr
        yield f"{ip}:{port}", tags
    finally:
        for tag in tags.values():
            kill_node(tag)
        shutil.rmtree(temp, ignore_errors=True)


def lockstep_run(run_dir: Path, *overrides: str) -> subprocess.Popen:
    """`lockstep run` as its own process, as from the command line: it joins (or starts) Ray once."""
    # Not this process's Ray settings: an earlier test's ray.init leaves RAY_* variables behind
    # (with them the run's actors were cancelled before they started on the cluster).
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "LOCKSTEP_TREE"}
    return subprocess.Popen([sys.executable, "-m", "lockstep.cli", "run", "--run-dir", str(run_dir), *overrides],
                            env={**env, "PYTHONWARNINGS": "ignore"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def finish(p: subprocess.Popen, timeout: float) -> None:
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("the run did not finish") from None
    assert p.returncode == 0, err[-3000:]


@pytest.mark.slow  # two nodes, two runs: ~4 min on 2 cores
def test_a_run_across_two_nodes_survives_losing_one(tmp_path, warm_dir, two_nodes):
    address, tags = two_nodes
    reference, d = tmp_path / "reference", tmp_path / "run"
    finish(lockstep_run(reference, *overrides(warm_dir)), 400)  # the same run on one local node, uninterrupted
    p = lockstep_run(d, *overrides(warm_dir), f"runtime.ray_address='{address}'", "runtime.placement='spread'")
    deadline, killed = time.time() + 300, 0
    while time.time() < deadline and p.poll() is None:
        steps = (d / "metrics.jsonl").read_text().count("rollout/reward_mean") if (d / "metrics.jsonl").exists() else 0
        if steps >= 2:
            killed = kill_node(tags["worker"])
            break
        time.sleep(0.05)
    if not killed:
        finish(p, 10)  # its error, if it failed
        raise AssertionError("the run ended before its worker node could be killed")
    finish(p, 400)
    summary = json.loads((d / "summary.json").read_text())
    started = json.loads((d / "nodes.json").read_text())

    # Before the kill: the trainer on the head node, the generator side on the worker node.
    head = started["trainer"]
    assert all(started[role] != head for role in ("generator", "generator1", "env0"))
    # After: everything on the head node, the lost actors restarted there.
    assert set(summary["nodes"].values()) == {head}
    c = summary["counters"]
    assert c["runtime/restarts"] >= 3 and c["runtime/actors_moved"] >= 3 and c.get("runtime/rollbacks", 0) == 0
    led = audit(d / "ledger.jsonl")
    assert led.pending() == []
    assert sorted(led.trained_step.values()) == sorted(s for s in range(1, 9) for _ in range(4))
    assert max(led.attempts.values()) >= 2  # the batch the lost node held was replayed
    got = load_file(str(d / "checkpoints" / "final" / "model.safetensors"))
    want = load_file(str(reference / "checkpoints" / "final" / "model.safetensors"))
    assert all((got[k] == want[k]).all() for k in want)  # the same run, bit for bit
