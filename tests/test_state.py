"""save_state / load_state: exact resume in a fresh process, atomic and verified checkpoints."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from lockstep.engine.checkpoint_io import CheckpointError
from lockstep.engine.trainer import Trainer
from lockstep.engine.types import AdamParams, Datum, LoraSpec

WORKER = str(Path(__file__).parent / "scripts" / "resume_worker.py")


# No thread or MKL setting is pinned: a user's run resumes exactly at the default thread count.
# (Multi-threaded MKL was not run-to-run reproducible on a busy machine, 1-2 fresh processes in 10
# at 2 threads: MKL_DYNAMIC gave calls fewer threads. Linear layers now go through the fused
# kernels' fixed tile plan, and MKL_DYNAMIC is off for what is left.)
WORKER_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "OMP_"))}


def run_worker(*args):
    subprocess.run([sys.executable, WORKER, *args], check=True, capture_output=True, timeout=300, env=WORKER_ENV)


@pytest.mark.slow  # ten fresh processes of training; resume-in-a-fresh-process stays in the default suite
def test_ten_fresh_processes_train_to_identical_weights(tmp_path, qwen2_dir):
    """Ten processes at once (a busy machine), each 6 steps from the same start: one set of weights."""
    procs = [subprocess.Popen([sys.executable, WORKER, "--model", qwen2_dir, "--steps", "6", "--weights-out",
                               str(tmp_path / f"w{i}.st")], env=WORKER_ENV, stderr=subprocess.PIPE)
             for i in range(10)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-2000:]
    runs = [load_file(str(tmp_path / f"w{i}.st")) for i in range(10)]
    first = runs[0]
    differing = [i for i, w in enumerate(runs) if not all(np.array_equal(first[k], w[k]) for k in first)]
    assert differing == []


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_resume_in_fresh_process_is_bitwise_exact(tmp_path, qwen2_dir, lora):
    flag = ["--lora"] if lora else []
    run_worker("--model", qwen2_dir, "--steps", "6", "--weights-out", str(tmp_path / "straight.st"), *flag)
    run_worker("--model", qwen2_dir, "--steps", "3", "--save", str(tmp_path / "state"),
               "--weights-out", str(tmp_path / "half.st"), *flag)
    run_worker("--model", qwen2_dir, "--steps", "3", "--load", str(tmp_path / "state"),
               "--weights-out", str(tmp_path / "resumed.st"), *flag)
    straight, half, resumed = (load_file(str(tmp_path / f)) for f in ("straight.st", "half.st", "resumed.st"))
    assert straight.keys() == resumed.keys()
    assert all(np.array_equal(straight[k], resumed[k]) for k in straight)
    assert not all(np.array_equal(straight[k], half[k]) for k in straight)  # training moved them
    meta = json.loads((tmp_path / "state" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["data_position"] == 3
    if lora:
        assert all("lora_" in k for k in straight)


def _trained(qwen2_dir, lora=None):
    t = Trainer.from_pretrained(qwen2_dir, lora=lora)
    t.forward_backward([Datum.from_tokens(list(range(5, 25)))], "cross_entropy")
    t.optim_step(AdamParams(learning_rate=1e-2))
    return t


def test_state_files_are_safetensors_and_json_with_manifest(tmp_path, qwen2_dir):
    path = _trained(qwen2_dir).save_state(tmp_path / "s")
    names = sorted(p.name for p in path.iterdir())
    assert names == ["MANIFEST.json", "meta.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors"]
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == set(names) - {"MANIFEST.json"}


def test_load_without_optimizer_resets_moments(tmp_path, qwen2_dir):
    t = _trained(qwen2_dir)
    t.save_state(tmp_path / "s")
    fresh = Trainer.from_pretrained(qwen2_dir)
    fresh.load_state(tmp_path / "s", optimizer=False)
    assert len(fresh.optimizer.state) == 0
    assert all(torch.equal(fresh.params[n], p) for n, p in t.params.items())
    fresh.load_state(tmp_path / "s", optimizer=True)
    p = next(iter(t.params.values()))
    assert torch.equal(fresh.optimizer.state[fresh.params[next(iter(t.params))]]["exp_avg"], t.optimizer.state[p]["exp_avg"])


@pytest.mark.parametrize("damage", ["manifest", "tensor", "meta"])
def test_torn_checkpoint_is_refused_and_changes_nothing(tmp_path, qwen2_dir, damage):
    path = _trained(qwen2_dir).save_state(tmp_path / "s")
    if damage == "manifest":
        (path / "MANIFEST.json").unlink()
    elif damage == "tensor":
        data = bytearray((path / "model.safetensors").read_bytes())
        data[-3] ^= 0xFF
        (path / "model.safetensors").write_bytes(bytes(data))
    else:
        (path / "meta.json").write_text("{}")
    fresh = Trainer.from_pretrained(qwen2_dir)
    before = {n: p.detach().clone() for n, p in fresh.params.items()}
    with pytest.raises(CheckpointError):
        fresh.load_state(path)
    assert all(torch.equal(p, before[n]) for n, p in fresh.params.items())
    assert fresh.step == 0


def test_lora_shape_mismatch_is_a_clear_error(tmp_path, qwen2_dir):
    path = _trained(qwen2_dir, LoraSpec(rank=4)).save_state(tmp_path / "s")
    other = Trainer.from_pretrained(qwen2_dir, lora=LoraSpec(rank=8))
    with pytest.raises(CheckpointError, match="shape"):
        other.load_state(path)
    with pytest.raises(CheckpointError, match="do not match"):
        Trainer.from_pretrained(qwen2_dir).load_state(path)
