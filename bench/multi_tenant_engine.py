"""Many LoRA tenants on one shared base, packed against one at a time, in the engine (issue 28).

    .venv/bin/python bench/multi_tenant_engine.py [--models builtin,qwen2-0.5b] [--tenants 1,4,8,16]
        [--train-tenants 1,4,8] [--repeats 3] [--json out.json]

Sampling: K tenants, each 4 rows (4 prompts of 16 tokens) x 32 new tokens at temperature 1, no
stop; "packed" is one Sampler.sample call with every tenant's rows (SampleRequest.adapter per
row), "alone" is one call per tenant. Training: K tenants, each forward_backward of 4 x 128
tokens (cross_entropy) then optim_step; "packed" is one packed_forward_backward, "alone" one
AdapterTrainer.forward_backward per tenant. Every adapter is rank 16 on all seven projections.
Packed and alone alternate per repeat (machine noise hits both alike); medians are reported, and
the packed results are checked bit for bit against the alone ones on the first repeat.

The 0.5B model is a random Qwen2 with Qwen2.5-0.5B's shapes (bench/gpu_check.py's QWEN2_05B: 494M
parameters), built in memory (no download, nothing written).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, "bench")
from common import machine, median, model_dir  # noqa: E402

from lockstep.engine.adapters import AdapterTrainer, SharedBase  # noqa: E402
from lockstep.engine.packed import packed_forward_backward  # noqa: E402
from lockstep.engine.sampler import Sampler  # noqa: E402
from lockstep.engine.types import AdamParams, Datum, LoraSpec, SampleRequest, SamplingParams, TrainGroup  # noqa: E402

ROWS, PROMPT, NEW = 4, 16, 32
TRAIN_ROWS, TRAIN_TOKENS = 4, 128
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
                 rope_theta=1000000.0, rms_norm_eps=1e-6)
"""As bench/gpu_check.py's (that script imports CUDA-only pieces, so the dict is repeated here)."""


def shared_base(name: str) -> SharedBase:
    if name == "builtin":
        return SharedBase.from_pretrained(model_dir("builtin"))
    from transformers import AutoModelForCausalLM, Qwen2Config

    from lockstep.engine.tiny import build_char_tokenizer

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_05B), dtype=torch.float32)
    return SharedBase(hf, build_char_tokenizer(), base_model="random-qwen2-0.5b-shape")


def tenants(base: SharedBase, k: int) -> list[AdapterTrainer]:
    out = []
    for i in range(k):
        t = AdapterTrainer(base, LoraSpec(rank=16, alpha=32.0, target_modules=ALL, seed=i), name=f"t{i}")
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for n, p in t.params.items():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        out.append(t)
    return out


def sample_requests(ts, vocab: int) -> list[list[SampleRequest]]:
    g = torch.Generator().manual_seed(1)
    return [[SampleRequest(tuple(torch.randint(4, vocab, (PROMPT,), generator=g).tolist()),
                           SamplingParams(max_tokens=NEW, seed=i * ROWS + j, stop=(), temperature=1.0),
                           adapter=t.snapshot()) for j in range(ROWS)] for i, t in enumerate(ts)]


def datums(ts, vocab: int) -> list[tuple[Datum, ...]]:
    g = torch.Generator().manual_seed(2)
    return [tuple(Datum.from_tokens(torch.randint(4, vocab, (TRAIN_TOKENS + 1,), generator=g).tolist())
                  for _ in range(TRAIN_ROWS)) for _ in ts]


def clock(fn) -> float:
    import time

    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_sampling(base, k: int, repeats: int) -> dict:
    ts = tenants(base, k)
    reqs = sample_requests(ts, base.vocab_size)
    sampler = Sampler(base.model, base.tokenizer)
    flat = [r for rs in reqs for r in rs]
    packed_s, alone_s, same = [], [], None
    for rep in range(repeats):
        out = {}
        alone_s.append(clock(lambda: out.__setitem__("alone", [sampler.sample(rs) for rs in reqs])))
        packed_s.append(clock(lambda: out.__setitem__("packed", sampler.sample(flat))))
        if rep == 0:
            same = [r for rs in out["alone"] for r in rs] == out["packed"]
    tokens = k * ROWS * NEW
    return {"tenants": k, "tokens": tokens, "alone_s": median(alone_s), "packed_s": median(packed_s),
            "alone_tok_s": tokens / median(alone_s), "packed_tok_s": tokens / median(packed_s),
            "speedup": median(alone_s) / median(packed_s), "bitwise_equal": same}


def bench_training(base, k: int, repeats: int) -> dict:
    ts = tenants(base, k)
    data = datums(ts, base.vocab_size)
    adam = AdamParams(learning_rate=1e-4)
    packed_s, alone_s, same = [], [], None

    def alone():
        outs = [t.forward_backward(d, "cross_entropy") for t, d in zip(ts, data)]
        for t in ts:
            t.optim_step(adam)
        return outs

    def packed():
        outs = packed_forward_backward(base, [TrainGroup(t, d) for t, d in zip(ts, data)])
        for t in ts:
            t.optim_step(adam)
        return outs

    for rep in range(repeats):
        if rep == 0:  # same weights for both: compare the losses and logprobs bit for bit
            start = [{n: p.detach().clone() for n, p in t.params.items()} for t in ts]
            moments = [t.optimizer.state_dict() for t in ts]
        out = {}
        alone_s.append(clock(lambda: out.__setitem__("alone", alone())))
        if rep == 0:
            for t, w, m in zip(ts, start, moments):
                with torch.no_grad():
                    for n, p in t.params.items():
                        p.copy_(w[n])
                t.optimizer.load_state_dict(m)
                t.step -= 1
        packed_s.append(clock(lambda: out.__setitem__("packed", packed())))
        if rep == 0:
            same = all(a.metrics == b.metrics and all((x["logprobs"] == y["logprobs"]).all() for x, y in
                                                      zip(a.loss_fn_outputs, b.loss_fn_outputs))
                       for a, b in zip(out["alone"], out["packed"]))
    tokens = k * TRAIN_ROWS * TRAIN_TOKENS
    return {"tenants": k, "tokens": tokens, "alone_s": median(alone_s), "packed_s": median(packed_s),
            "speedup": median(alone_s) / median(packed_s), "bitwise_equal": same}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="builtin,qwen2-0.5b")
    ap.add_argument("--tenants", default="1,4,8,16")
    ap.add_argument("--train-tenants", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    report = {"machine": machine(), "results": []}
    for name in args.models.split(","):
        base = shared_base(name)
        for k in (int(x) for x in args.tenants.split(",") if x):
            r = {"model": name, "kind": "sample", **bench_sampling(base, k, args.repeats)}
            print(json.dumps(r), flush=True)
            report["results"].append(r)
        for k in (int(x) for x in args.train_tenants.split(",") if x):
            r = {"model": name, "kind": "train", **bench_training(base, k, args.repeats)}
            print(json.dumps(r), flush=True)
            report["results"].append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
