"""bench/gpu_check.py, the one script a GPU session runs, end to end on the CPU under Triton's
interpreter at toy sizes (--cpu-smoke): a bug in it is found here, not in a GPU session's few
minutes of device time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu-smoke"]


@pytest.mark.slow  # 8-10 min on 2 quiet cores (every kernel of the check under the interpreter); 15+ loaded
@pytest.mark.timeout(2400)
def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([*SCRIPT, "--out", str(out)], cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=2300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["environment"]["gpu"] is None
    assert set(report["consistency"]) == {"qwen2-random/float32", "qwen2-random/bfloat16"}
    for case in report["consistency"].values():  # the engine's sampler and trainer agree bit for bit
        assert "interpreter" in case["path"] and case["tokens_compared"] > 0
        assert case["tokens_bitwise_equal"] == case["tokens_compared"] and case["max_abs_diff"] == 0.0
        assert case["hf_tokens_compared"] > 0
    sampler, train = report["sampler"], report["train"]
    assert sampler["lockstep_tok_s"] > 0 and sampler["hf_generate_tok_s"] > 0 and sampler["ratio"] > 0
    assert train["lockstep_step_s"] > 0 and train["transformers_step_s"] > 0 and train["flops_per_step"] > 0
    assert train["lockstep_mfu"] > 0 and train["transformers_mfu"] > 0 and report["peak_tflops"] > 0
    dp = report["data_parallel"]  # a data-parallel step's gradients are one trainer's, bit for bit
    assert dp["micro_batches"] == 2 and dp["tensors_compared"] > 0
    assert dp["tensors_bitwise_equal"] == dp["tensors_compared"] and dp["max_abs_diff"] == 0.0
    assert "| train step s" in proc.stdout and "| consistency qwen2-random/bfloat16" in proc.stdout
    assert "| data-parallel step = one trainer" in proc.stdout


def test_the_cpu_smoke_run_asks_for_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(SCRIPT, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--cpu-smoke needs TRITON_INTERPRET=1" in proc.stderr
