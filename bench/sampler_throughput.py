"""New tokens/s of lockstep's sampler against HF `generate`, batch 64, side by side in one run.

    .venv/bin/python bench/sampler_throughput.py [--sizes builtin,5M,20M] [--repeats 3]

All decode 64 prompts x 64 new tokens with sampling at temperature 1 and no stop; runs alternate
(fused, eager, HF, fused, ...) so machine noise hits all alike; medians are reported. "fused" is
the default forward (the C++ kernels); "eager" is the pure-PyTorch path it replaced (the fallback,
with torch's own mm as before). Then a profile: ATen ops and kernel calls per decode step.
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "bench")
from common import emit, median, model_dir, timed  # noqa: E402

from lockstep.engine import invariant as inv  # noqa: E402
from lockstep.engine.loading import load_model  # noqa: E402
from lockstep.engine.model import InvariantLM  # noqa: E402
from lockstep.engine.sampler import Sampler  # noqa: E402
from lockstep.engine.types import SampleRequest, SamplingParams  # noqa: E402

BATCH, NEW = 64, 64


def prompts(tok):
    return [tok.encode(f"{i * 37 % 1000}+{i * 91 % 1000}=") for i in range(BATCH)]


def ours(sampler, ps):
    reqs = [SampleRequest(tuple(p), SamplingParams(max_tokens=NEW, seed=i, stop=())) for i, p in enumerate(ps)]
    return lambda: sampler.sample(reqs)


def hf_generate(model, tok, ps):
    T = max(map(len, ps))
    ids = torch.full((BATCH, T), tok.pad_token_id)
    att = torch.zeros(BATCH, T, dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, T - len(p):] = torch.tensor(p)
        att[i, T - len(p):] = 1

    def run():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=att, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                           max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=tok.pad_token_id)
    return run


def eager(sampler, ps):
    """The pure-PyTorch path as it was: eager ops and torch's mm (no fixed tile plan)."""
    run = ours(sampler, ps)

    def go():
        fixed, inv._fixed_plan_linear = inv._fixed_plan_linear, None
        try:
            return run()
        finally:
            inv._fixed_plan_linear = fixed
    return go


def ops_per_step(fn, steps: int) -> dict:
    """Calls seen by torch's profiler (ATen ops, our kernels, Python-bound ops) per decode step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    return {"aten_ops_per_step": aten / steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="builtin,5M,20M")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for size in args.sizes.split(","):
        hf, tok = load_model(model_dir(size))
        hf_sdpa, _ = load_model(model_dir(size))
        hf_sdpa.config._attn_implementation = "sdpa"
        fused_model = InvariantLM(hf)
        assert fused_model.path == "fused", fused_model.path_reason
        eager_model = InvariantLM(hf)
        eager_model.path = "eager"
        ps = prompts(tok)
        fns = {"fused": ours(Sampler(fused_model, tok), ps), "eager": eager(Sampler(eager_model, tok), ps),
               "hf_generate": hf_generate(hf_sdpa, tok, ps)}
        for f in fns.values():  # warm-up
            f()
        times = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, f in fns.items():
                times[k] += timed(f, 1)
        n_params = sum(p.numel() for p in hf.parameters())
        t = {k: median(v) for k, v in times.items()}
        ops = {k: ops_per_step(fns[k], NEW)["aten_ops_per_step"] for k in ("fused", "eager", "hf_generate")}
        rows.append({"model": size, "params_M": n_params / 1e6,
                     "fused_tok_s": BATCH * NEW / t["fused"], "eager_tok_s": BATCH * NEW / t["eager"],
                     "hf_generate_tok_s": BATCH * NEW / t["hf_generate"],
                     "fused_vs_hf": t["hf_generate"] / t["fused"], "eager_vs_hf": t["hf_generate"] / t["eager"],
                     "ops_per_step_fused": ops["fused"], "ops_per_step_eager": ops["eager"],
                     "ops_per_step_hf": ops["hf_generate"]})
    emit("sampler_throughput", rows, {"batch": BATCH, "new_tokens": NEW})


if __name__ == "__main__":
    main()
