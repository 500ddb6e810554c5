"""K LoRA tenants through the service's engine host (EngineHost.run_batch), packed against sequential.

    .venv/bin/python bench/multi_tenant_service.py [--models builtin,20M] [--tenants 1,4,8]
        [--repeats 3] [--threads 1] [--json out.json]

Each tenant is a LoRA client (rank 16, attention and MLP: on the shared base) with a sampling
session on its snapshot. A round is what the Executor runs for K tenants' queued requests:
forward_backward (4 datums x 32 tokens each), then optim_step per tenant (alone, as packing.py
runs it), then sample (a 16-token prompt, 4 samples x 16 new tokens, seeded). "sequential" hands
run_batch one member at a time (what the host did before a batch became one engine call);
"packed" hands it the K members at once. Two hosts, one per mode, with the same tenants; the modes
alternate per repeat; tokens/s is over all repeats (each repeat has new requests). Every repeat
checks that both modes' response bytes are equal.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, "bench")
from common import machine, model_dir

from lockstep.service import wire
from lockstep.service.host import EngineHost
from lockstep.service.types import BatchMember

LORA = {"rank": 16, "train_unembed": False}
FB_ROWS, FB_TOKENS = 4, 32
PROMPT, SAMPLES, NEW = 16, 4, 16
ADAM = {"learning_rate": 1e-4}


def fb_body(mid: str, rng, vocab: int) -> bytes:
    data = tuple(wire.WireDatum(tuple(int(t) for t in rng.integers(4, vocab, FB_TOKENS)),
                                {"target_tokens": rng.integers(4, vocab, FB_TOKENS).astype(np.int64),
                                 "weights": np.ones(FB_TOKENS, np.float32)}) for _ in range(FB_ROWS))
    return wire.encode_forward_backward(wire.FwdBwd(mid, 1, data, "cross_entropy", {}, False))


def sample_body(rng, vocab: int, seed: int) -> dict:
    prompt = [int(t) for t in rng.integers(4, vocab, PROMPT)]
    return {"prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]}, "num_samples": SAMPLES,
            "sampling_params": {"max_tokens": NEW, "temperature": 1.0, "seed": seed, "stop": []}}


def host_with(tmp: str, name: str, base: str, k: int, threads: int) -> EngineHost:
    host = EngineHost(f"{tmp}/{name}/storage", f"{tmp}/{name}/cache", threads)
    for i in range(k):
        host.create_model(f"t{i}", base, {**LORA, "seed": i})
        host.snapshot_session(f"t{i}", f"s{i}", f"snap/t{i}", base, {**LORA, "seed": i})
    return host


def run(host: EngineHost, kind: str, members: list, packed: bool) -> tuple[list, float]:
    start = time.perf_counter()
    out = host.run_batch(kind, members) if packed else [r for m in members for r in host.run_batch(kind, [m])]
    elapsed = time.perf_counter() - start
    bad = [r for r in out if isinstance(r, Exception)]
    assert not bad, bad
    return out, elapsed


def bench(base: str, k: int, repeats: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        hosts = {mode: host_with(tmp, mode, base, k, threads) for mode in ("sequential", "packed")}
        vocab = hosts["packed"].bases[base].vocab_size
        secs = {(mode, kind): [] for mode in hosts for kind in ("fb", "sample")}
        same, tokens = True, {"fb": 0, "sample": 0}
        for rep in range(repeats):
            rng = np.random.default_rng(rep)
            fbs = [BatchMember(f"t{i}", fb_body(f"t{i}", rng, vocab)) for i in range(k)]
            samples = [BatchMember(f"s{i}", sample_body(rng, vocab, 100 * rep + i)) for i in range(k)]
            outs = {}
            for mode in (("sequential", "packed") if rep % 2 == 0 else ("packed", "sequential")):
                host = hosts[mode]
                out_fb, t_fb = run(host, "forward_backward", fbs, mode == "packed")
                for i in range(k):
                    host.optim_step(f"t{i}", ADAM)
                out_s, t_s = run(host, "sample", samples, mode == "packed")
                secs[(mode, "fb")].append(t_fb)
                secs[(mode, "sample")].append(t_s)
                outs[mode] = (out_fb, out_s)
            same = same and outs["sequential"] == outs["packed"]
            for j, kind in enumerate(("fb", "sample")):  # trained tokens; sampled ones (a row may stop early)
                tokens[kind] += sum(n for _, n in outs["packed"][j])
        row = {"tenants": k}
        for kind in ("fb", "sample"):
            seq, pk = sum(secs[("sequential", kind)]), sum(secs[("packed", kind)])
            row |= {f"{kind}_seq_tok_s": tokens[kind] / seq, f"{kind}_packed_tok_s": tokens[kind] / pk,
                    f"{kind}_speedup": seq / pk}
        row["bitwise_equal"] = same
        return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="builtin,20M")
    ap.add_argument("--tenants", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    report = {"machine": machine(), "results": []}
    for name in args.models.split(","):
        base = model_dir(name)
        for k in (int(x) for x in args.tenants.split(",") if x):
            r = {"model": name, **bench(base, k, args.repeats, args.threads)}
            print(json.dumps({n: round(v, 2) if isinstance(v, float) else v for n, v in r.items()}), flush=True)
            report["results"].append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
