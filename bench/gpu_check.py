"""The CUDA path on one GPU, engine-level (no Ray): what bench/gpu_check.sh runs.

1. Consistency (`lockstep check consistency --device cuda`'s workload, engine/consistency.py) on
   the built-in model and on a randomly initialised Qwen2 of about 0.5B parameters (Qwen2-0.5B's
   shape): sampler (KV-cache decode) against trainer (full forward), tokens compared, bitwise equal,
   max |Δlogp|, and the same for plain transformers (HF `generate` against a padded forward).
2. Sampler throughput: new tokens/s of lockstep's sampler against HF `generate` (sdpa attention),
   batch 64, bf16, the 0.5B model.
3. Train step: the invariant trainer's step (forward_backward + optim_step) against the plain
   transformers step (autocast bf16 over float32 weights, loss.backward, AdamW), same batch.
4. MFU of both train steps against the measured bf16 matmul peak (8192^3 products).
5. Data parallel: a step of GRPO groups (shared prompts, so the trainer shares their prefixes)
   under GSPO, one trainer accumulating its micro-batches against each micro-batch's gradient
   computed alone (in reverse order, as ranks finish in any order) and summed in micro-batch
   order, engine/data_parallel.py's chain: the gradients must be the same bits. One GPU cannot
   hold two NCCL ranks, so the ranks are emulated in one process; what a rank changes is only
   where a micro-batch's gradient is computed, which is what this compares.

Writes one JSON object (--out) and prints a table. --quick shrinks every size (a short GPU run);
--cpu-smoke runs every step on the CPU under Triton's interpreter (TRITON_INTERPRET=1) at toy
sizes, so that a bug in this script is found here and not in a GPU session's few minutes
(tests/test_gpu_check_script.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lockstep.engine import consistency  # noqa: E402
from lockstep.engine.device import Compute  # noqa: E402
from lockstep.engine.sampler import Sampler  # noqa: E402
from lockstep.engine.tiny import ensure_tiny_model, save_model_dir  # noqa: E402
from lockstep.engine.trainer import Trainer  # noqa: E402
from lockstep.engine.types import AdamParams, Datum, SampleRequest, SamplingParams  # noqa: E402

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
                 rope_theta=1000000.0, rms_norm_eps=1e-6)
"""Qwen2-0.5B's architecture (its config.json), randomly initialised: 494M parameters."""


@dataclass(frozen=True)
class Sizes:
    """How big each part of the check is."""

    device: str
    shape: dict  # the random Qwen2's config
    consistency_tokens: int
    consistency_batches: tuple[int, ...]
    sample_batch: int
    sample_prompt: int
    sample_new: int
    train_batch: int
    train_seq: int
    repeats: int
    peak_n: int
    dp_micro_batches: int
    """Data parallel: micro-batches of one step, each a group of dp_group completions of a prompt."""
    dp_group: int
    dp_prompt: int
    dp_completion: int
    builtin: bool = True
    """Also check the built-in model (under the interpreter it alone takes ~10 minutes)."""

    @property
    def compute_kw(self) -> dict:
        """Compute() arguments: on a CPU the Triton kernels run under the interpreter."""
        return {"device": self.device, "kernels": "triton"}


FULL = Sizes("cuda", QWEN2_05B, 16, consistency.BATCH_SIZES, 64, 64, 128, 16, 512, 3, 8192, 3, 8, 256, 128)
QUICK = Sizes("cuda", dict(QWEN2_05B, num_hidden_layers=4), 8, consistency.BATCH_SIZES, 64, 64, 32, 4, 256, 1, 8192,
              2, 4, 64, 32)
CPU_SMOKE = Sizes("cpu", dict(QWEN2_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
                  2, (1, 3), 2, 5, 3, 2, 16, 1, 64, 2, 3, 6, 3, builtin=False)
SIZES: Sizes = FULL
"""The sizes of this run (main() sets them)."""


def sync() -> None:
    if SIZES.device == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    if SIZES.device == "cuda":
        torch.cuda.empty_cache()


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up (Triton compiles on first use)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def environment() -> dict:
    import transformers
    import triton

    versions = {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                "python": sys.version.split()[0]}
    if SIZES.device != "cuda":
        return {"gpu": None, "device": "cpu (Triton's interpreter)", **versions}
    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1),
            "cuda": torch.version.cuda, **versions}


def random_qwen2(root: Path) -> Path:
    from transformers import Qwen2Config

    return save_model_dir(root / "qwen2-random", Qwen2Config(**SIZES.shape), seed=0)


def random_tokens(rows: int, length: int, vocab: int) -> torch.Tensor:
    """Token ids past the char tokenizer's specials, below the vocabulary's size."""
    return torch.randint(4, min(4000, vocab), (rows, length), generator=torch.Generator().manual_seed(0))


def check_consistency(model_dir: Path, dtype: str) -> dict:
    t = time.perf_counter()
    r = consistency.run(str(model_dir), max_tokens=SIZES.consistency_tokens, batch_sizes=SIZES.consistency_batches,
                        compute=Compute(dtype=dtype, **SIZES.compute_kw))
    return {"path": r["path_reason"], "tokens_compared": r["tokens_compared"], "tokens_bitwise_equal": r["tokens_bitwise_equal"],
            "max_abs_diff": r["max_abs_diff"], "hf_tokens_compared": r["hf"]["tokens_compared"],
            "hf_tokens_bitwise_equal": r["hf"]["tokens_bitwise_equal"], "hf_max_abs_diff": r["hf"]["max_abs_diff"],
            "seconds": round(time.perf_counter() - t, 1)}


def sampler_throughput(model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    batch, prompt_len, new_tokens, repeats = SIZES.sample_batch, SIZES.sample_prompt, SIZES.sample_new, SIZES.repeats
    prompts = random_tokens(batch, prompt_len, SIZES.shape["vocab_size"])
    trainer = Trainer.from_pretrained(model_dir, compute=Compute(dtype="bfloat16", **SIZES.compute_kw))
    sampler = Sampler(trainer.model, trainer.tokenizer)
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, stop=(), seed=1)
    requests = [SampleRequest(tuple(p.tolist()), params) for p in prompts]
    ours = timed(lambda: sampler.sample(requests), repeats)
    del trainer, sampler
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.to(SIZES.device).eval()
    ids = prompts.to(SIZES.device)

    def generate():
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                        max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    theirs = timed(generate, repeats)
    del hf
    free_memory()
    tokens = batch * new_tokens
    return {"batch": batch, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "lockstep_tok_s": round(tokens / ours),
            "hf_generate_tok_s": round(tokens / theirs), "ratio": round(theirs / ours, 3)}


def train_steps(model_dir: Path) -> dict:
    """Seconds per step of both trainers on the same token batch, and their model FLOPs per step."""
    from transformers import AutoModelForCausalLM

    batch, seq, repeats = SIZES.train_batch, SIZES.train_seq, SIZES.repeats
    tokens = random_tokens(batch, seq, SIZES.shape["vocab_size"])
    data = [Datum.from_tokens(row.tolist()) for row in tokens]
    adam = AdamParams(learning_rate=1e-5)
    trainer = Trainer.from_pretrained(model_dir, compute=Compute(dtype="bfloat16", **SIZES.compute_kw))
    n_params = sum(p.numel() for n, p in trainer.params.items() if "embed_tokens" not in n)

    def ours():
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(adam)

    ours_s = timed(ours, repeats)
    del trainer
    free_memory()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    hf = hf.to(SIZES.device).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5)
    ids = tokens.to(SIZES.device)

    def plain():
        with torch.autocast(SIZES.device, dtype=torch.bfloat16):
            loss = hf(input_ids=ids, labels=ids).loss * ids.numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    plain_s = timed(plain, repeats)
    del hf, opt
    free_memory()
    # 6 N per token (forward 2N, backward 4N) for the matmul weights, the tied unembedding included.
    lm_head = SIZES.shape["hidden_size"] * SIZES.shape["vocab_size"]
    flops = 6 * (n_params + lm_head) * batch * seq
    return {"batch": batch, "seq": seq, "lockstep_step_s": round(ours_s, 4), "transformers_step_s": round(plain_s, 4),
            "ratio": round(ours_s / plain_s, 3), "flops_per_step": flops}


def grpo_step(micro_batches: int, group: int, prompt: int, completion: int, vocab: int) -> list[list[Datum]]:
    """A step's micro-batches: each one group of `group` completions of its own prompt, with the
    sampler logprobs and advantages GSPO reads."""
    g = torch.Generator().manual_seed(7)
    parts = []
    for m in range(micro_batches):
        head = random_tokens(1, prompt, vocab)[0].roll(m).tolist()
        part = []
        for _ in range(group):
            tail = torch.randint(4, min(4000, vocab), (completion,), generator=g).tolist()
            n = prompt + completion - 1
            mask = [0.0] * (prompt - 1) + [1.0] * completion  # the sampled tokens form the sequence ratio
            part.append(Datum.from_tokens(head + tail, mask, sequence_ratio_mask=mask,
                                          logprobs=(-0.5 - 2.5 * torch.rand(n, generator=g)).numpy(),
                                          advantages=torch.full((n,), float(torch.randn(1, generator=g))).numpy()))
        parts.append(part)
    return parts


def data_parallel_step(model_dir: Path) -> dict:
    """One trainer's accumulated gradients against each micro-batch's alone, summed in order."""
    parts = grpo_step(SIZES.dp_micro_batches, SIZES.dp_group, SIZES.dp_prompt, SIZES.dp_completion,
                      SIZES.shape["vocab_size"])
    trainer = Trainer.from_pretrained(model_dir, compute=Compute(dtype="bfloat16", **SIZES.compute_kw))
    t = time.perf_counter()
    for part in parts:  # one trainer: autograd accumulates in micro-batch order
        trainer.forward_backward(part, "gspo")
    one = {n: p.grad.clone() for n, p in trainer.params.items() if p.grad is not None}
    trainer.zero_grad()
    alone: list = [None] * len(parts)
    for m in reversed(range(len(parts))):  # each "rank" computes its micro-batch on its own
        trainer.forward_backward(parts[m], "gspo")
        alone[m] = {n: p.grad.clone() for n, p in trainer.params.items() if p.grad is not None}
        trainer.zero_grad()
    sync()
    seconds = time.perf_counter() - t
    equal, worst, compared = 0, 0.0, len(one)
    for name, g in one.items():
        chained = alone[0][name]
        for grads in alone[1:]:  # engine/data_parallel.py's chain: running sum in micro-batch order
            chained = chained + grads[name]
        equal += bool(torch.equal(chained, g))
        worst = max(worst, float((chained - g).abs().max()))
    del trainer, one, alone
    free_memory()
    return {"micro_batches": len(parts), "datums": sum(map(len, parts)), "loss": "gspo", "dtype": "bfloat16",
            "tensors_bitwise_equal": equal, "tensors_compared": compared, "max_abs_diff": worst,
            "seconds": round(seconds, 1)}


def matmul_peak(n: int, repeats: int) -> float:
    """Measured bf16 TFLOP/s of an n^3 product (random data)."""
    a, b = (torch.randn(n, n, device=SIZES.device, dtype=torch.bfloat16) for _ in range(2))
    s = timed(lambda: a @ b, repeats)
    return 2 * n**3 / s / 1e12


def table(report: dict) -> str:
    rows = ["| check | lockstep | transformers |", "| --- | --- | --- |"]
    for name, c in report["consistency"].items():
        rows.append(f"| consistency {name}: bitwise equal / compared (max abs dlogp) | {c['tokens_bitwise_equal']}/"
                    f"{c['tokens_compared']} ({c['max_abs_diff']:.3g}) | {c['hf_tokens_bitwise_equal']}/"
                    f"{c['hf_tokens_compared']} ({c['hf_max_abs_diff']:.3g}) |")
    s = report["sampler"]
    rows.append(f"| sampler new tokens/s, batch {s['batch']} (lockstep / HF generate = {s['ratio']}) | "
                f"{s['lockstep_tok_s']} | {s['hf_generate_tok_s']} |")
    d = report["data_parallel"]
    rows.append(f"| data-parallel step = one trainer: gradients bitwise equal / compared (max abs diff) | "
                f"{d['tensors_bitwise_equal']}/{d['tensors_compared']} ({d['max_abs_diff']:.3g}) | |")
    t = report["train"]
    rows.append(f"| train step s, {t['batch']}x{t['seq']} tokens (ratio {t['ratio']}, goal <= 1.3) | "
                f"{t['lockstep_step_s']} | {t['transformers_step_s']} |")
    rows.append(f"| train MFU vs measured bf16 peak {report['peak_tflops']:.0f} TFLOP/s | {t['lockstep_mfu']:.3f} | "
                f"{t['transformers_mfu']:.3f} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_check.json", help="where the JSON goes")
    ap.add_argument("--quick", action="store_true", help="small sizes (a short GPU run)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="every step on the CPU under Triton's interpreter at toy sizes (needs TRITON_INTERPRET=1)")
    a = ap.parse_args()
    global SIZES
    SIZES = CPU_SMOKE if a.cpu_smoke else QUICK if a.quick else FULL
    if SIZES.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no GPU", file=sys.stderr)
        return 2
    if SIZES.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("gpu_check: --cpu-smoke needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
        return 2
    report: dict = {"date": time.strftime("%Y-%m-%d"), "environment": environment(), "consistency": {}}
    print(json.dumps(report["environment"]), flush=True)
    name = "qwen2-0.5b" if SIZES.shape is QWEN2_05B else "qwen2-random"
    with tempfile.TemporaryDirectory() as tmp:
        qwen = random_qwen2(Path(tmp))
        cases = [(f"{name}/bfloat16", qwen, "bfloat16")]
        if SIZES.builtin:
            builtin = ensure_tiny_model(Path(tmp) / "builtin")
            cases = [("builtin/float32", builtin, "float32"), ("builtin/bfloat16", builtin, "bfloat16"), *cases]
        else:
            cases = [(f"{name}/float32", qwen, "float32"), *cases]
        for case, path, dtype in cases:
            report["consistency"][case] = check_consistency(path, dtype)
            print(case, json.dumps(report["consistency"][case]), flush=True)
        report["sampler"] = sampler_throughput(qwen)
        print("sampler", json.dumps(report["sampler"]), flush=True)
        report["train"] = train_steps(qwen)
        report["data_parallel"] = data_parallel_step(qwen)
        print("data_parallel", json.dumps(report["data_parallel"]), flush=True)
    peak = matmul_peak(SIZES.peak_n, 10)
    report["peak_tflops"] = round(peak, 3)
    t = report["train"]
    for side in ("lockstep", "transformers"):
        t[f"{side}_mfu"] = t["flops_per_step"] / t[f"{side}_step_s"] / (peak * 1e12)
    print("train", json.dumps(t), flush=True)
    Path(a.out).write_text(json.dumps(report, indent=2))
    print(table(report))
    exact = all(c["tokens_bitwise_equal"] == c["tokens_compared"] for c in report["consistency"].values())
    d = report["data_parallel"]
    return 0 if exact and d["tensors_bitwise_equal"] == d["tensors_compared"] else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
