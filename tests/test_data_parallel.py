"""Data-parallel training (engine/data_parallel.py): N processes (gloo) end bit for bit where one
process accumulating the same micro-batches ends, for any N, and a checkpoint taken under one N
resumes exactly under another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from lockstep.engine.data_parallel import shares
from lockstep.engine.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from dp_worker import ADAM, micro_batches  # noqa: E402
from helpers import free_port

WORKER = str(Path(__file__).parent / "scripts" / "dp_worker.py")
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "OMP_"))}
MICRO = 5


def data_parallel(tmp: Path, model: str, world: int, steps: int, *, load=None, save=None) -> list[dict]:
    """Run `world` ranks to the end; the weights each rank ended with."""
    port, outs = free_port(), [tmp / f"rank{r}.st" for r in range(world)]
    extra = (["--load", str(load)] if load else []) + (["--save", str(save)] if save else [])
    procs = [subprocess.Popen([sys.executable, WORKER, "--model", model, "--rank", str(r), "--world", str(world),
                               "--port", str(port), "--steps", str(steps), "--micro", str(MICRO),
                               "--weights-out", str(outs[r]), *extra], env=ENV, stderr=subprocess.PIPE)
             for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-3000:]
    return [load_file(str(o)) for o in outs]


def one_process(model: str, steps: int) -> dict:
    trainer = Trainer.from_pretrained(model)
    for step in range(steps):
        for mb in micro_batches(step, MICRO):  # gradients accumulate in micro-batch order
            trainer.forward_backward(mb, "cross_entropy")
        trainer.optim_step(ADAM)
    return trainer.weights_numpy()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)) for k in a)


def differences(ranks: list[dict], reference: dict) -> str:
    """Per rank, the tensors that differ from the reference and by how much (a failure's trace)."""
    out = []
    for r, w in enumerate(ranks):
        bad = {k: float(np.abs(w[k] - reference[k]).max()) for k in reference if not np.array_equal(w[k], reference[k])}
        out.append(f"rank {r}: {len(bad)} of {len(reference)} tensors differ, e.g. {dict(list(bad.items())[:4])}")
    return "; ".join(out)


def test_shares_are_contiguous_and_cover_every_micro_batch():
    for m in range(0, 9):
        for n in range(1, 5):
            ranges = shares(m, n)
            assert [i for r in ranges for i in r] == list(range(m)) and max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.fixture(scope="module")
def reference(builtin_dir):
    return one_process(builtin_dir, 3)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_n_ranks_equal_one_process_bit_for_bit(tmp_path, builtin_dir, reference, world):
    ranks = data_parallel(tmp_path, builtin_dir, world, 3)
    assert all(same(w, reference) for w in ranks)  # every rank, and the one-process run: one set of bits


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_checkpoint_resumes_under_another_number_of_ranks(tmp_path, builtin_dir, reference):
    ckpt = tmp_path / "ckpt"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    data_parallel(tmp_path / "a", builtin_dir, 2, 2, save=ckpt)  # 2 steps under 2 ranks, one checkpoint
    ranks = data_parallel(tmp_path / "b", builtin_dir, 3, 1, load=ckpt)  # the third under 3 ranks
    assert all(same(w, reference) for w in ranks), differences(ranks, reference)


FAILING_MICRO = shares(MICRO, 3)[1].start  # rank 1's first micro-batch


@pytest.fixture
def ranks_ready(tmp_path, builtin_dir):
    """3 ranks, started and loaded (each said so), waiting for the test's go to take one step, in
    which rank 1 raises RuntimeError on FAILING_MICRO. Killed at teardown, whatever happened."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, "--model", builtin_dir, "--rank", str(r), "--world", "3",
                               "--port", str(port), "--steps", "1", "--micro", str(MICRO),
                               "--weights-out", str(tmp_path / f"rank{r}.st"), "--fail-rank", "1",
                               "--fail-micro", str(FAILING_MICRO)],
                              env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(3)]
    try:
        for r, p in enumerate(procs):
            assert json.loads(p.stdout.readline() or "null") == {"ready": r}, p.stderr.read()[-3000:]
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


# Timed from the go (func_only: the ranks' start-up is in the fixture), far below gloo's 300 s.
@pytest.mark.timeout(120, func_only=True)
@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_an_internal_error_on_one_rank_fails_the_step_on_every_rank_at_once(tmp_path, builtin_dir, ranks_ready):
    """Rank 1 raises RuntimeError (not an EngineError) on its first micro-batch of step 0. It still
    takes its part in the gradient chain, so every rank's step fails at once: rank 1 with its own
    error, the others with PeerFailed naming rank 1 and the micro-batch (before, they waited in the
    chain for gloo's 300 s timeout). No rank applied a gradient: each ends with the base weights."""
    for p in ranks_ready:  # every rank goes before any is waited on
        p.stdin.write("go\n")
        p.stdin.flush()
    # Each rank's report of its failed step; the ranks stay alive (their connections open, as a
    # trainer actor's after a failed call) until stdin closes, so none is freed by another's exit.
    reports = [json.loads(p.stdout.readline() or "null") for p in ranks_ready]
    outs = [p.communicate() for p in ranks_ready]
    for p, (_, err) in zip(ranks_ready, outs):
        assert p.returncode == 0, err[-3000:]
    assert reports[1] == {"rank": 1, "step": 0, "error": "RuntimeError",
                          "message": "injected: an internal error on this rank"}
    for r in (0, 2):
        assert reports[r]["step"] == 0 and reports[r]["error"] == "PeerFailed"
        assert f"micro-batch {FAILING_MICRO} failed on rank 1 of 3" in reports[r]["message"]
    base = Trainer.from_pretrained(builtin_dir).weights_numpy()
    assert all(same(load_file(str(tmp_path / f"rank{r}.st")), base) for r in range(3))


def test_an_all_reduce_of_partial_sums_would_not_be_exact(builtin_dir):
    """Why the sum is chained: adding two ranks' partial sums rounds differently from one process's
    running sum (this is what the test above would catch)."""
    trainer = Trainer.from_pretrained(builtin_dir)
    grads = []
    for mb in micro_batches(0, 4):
        trainer.forward_backward(mb, "cross_entropy")
        grads.append({n: p.grad.clone() for n, p in trainer.params.items()})
        trainer.zero_grad()
    running = {n: ((grads[0][n] + grads[1][n]) + grads[2][n]) + grads[3][n] for n in grads[0]}
    pairwise = {n: (grads[0][n] + grads[1][n]) + (grads[2][n] + grads[3][n]) for n in grads[0]}
    assert any(not np.array_equal(running[n].numpy(), pairwise[n].numpy()) for n in running)
