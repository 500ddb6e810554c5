"""`lockstep check consistency`: measure sampler-vs-trainer logprob agreement.

For a mixed workload (prompt lengths 1..48; batches of 1, 7 and 64; LoRA off and on), the
sampler decodes with a KV cache while the trainer recomputes every sampled token's logprob with its
full-sequence forward, on a separate copy of the weights (as after a weight publish), at each pair
of thread counts in THREADS (sampler, trainer): 1, 2 and 4 threads on either side. The summary says
which forward ran ("fused" kernels or the "eager" pure-PyTorch path) and why. For a mixture of
experts it also compares every token's expert choices (sampler decode against trainer forward):
`routing_equal` of `routing_compared` (LoRA-on cases are skipped: not supported there yet). With
`speculative` set to a drafter, the sampler decodes speculatively (drafts verified in its
forward; every other prompt greedily, so that drafts are accepted even on an untrained model), and
the summary counts the drafted and accepted tokens. The same is measured for plain
transformers (`generate` with `output_logits` against a padded full forward) as the comparison.

`run_tenants` (`--tenants K`) checks many LoRA tenants on one shared base instead: each tenant's
sampler rows and trainer datums packed with the others against alone, bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import random
from dataclasses import dataclass, field

import torch

from lockstep.config.types import DRAFTERS
from lockstep.engine.device import Compute
from lockstep.engine.drafters import make_drafter
from lockstep.engine.model import InvariantLM, RoutingLog
from lockstep.engine.prefix import plan_prefixes
from lockstep.engine.sampler import Sampler
from lockstep.engine.trainer import Trainer
from lockstep.engine.types import Datum, EngineError, LoraSpec, SampleRequest, SamplingParams

BATCH_SIZES = (1, 7, 64)
THREADS = ((1, 4), (2, 1), (4, 2))
"""(sampler threads, trainer threads) per case: every count on both sides, never the same pair."""


@dataclass
class Tally:
    """Running comparison of two logprob streams."""

    compared: int = 0
    equal: int = 0
    max_abs: float = 0.0
    sum_abs: float = 0.0
    cases: list = field(default_factory=list)
    routing_compared: int = 0
    routing_equal: int = 0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, float]:
        diff = (a.double() - b.double()).abs()
        n, eq, mx = diff.numel(), int((a == b).sum()), float(diff.max()) if diff.numel() else 0.0
        self.compared += n
        self.equal += eq
        self.max_abs = max(self.max_abs, mx)
        self.sum_abs += float(diff.sum())
        return n, eq, mx

    def summary(self) -> dict:
        return {
            "tokens_compared": self.compared,
            "tokens_bitwise_equal": self.equal,
            "max_abs_diff": self.max_abs,
            "mean_abs_diff": self.sum_abs / max(self.compared, 1),
            "routing_compared": self.routing_compared,
            "routing_equal": self.routing_equal,
        }


def _prompts(rng: random.Random, n: int, vocab: int) -> list[tuple[int, ...]]:
    lengths = [rng.choice((1, 2, 5, 9, 17, 31, 48)) for _ in range(n)]
    return [tuple(rng.randrange(4, vocab) for _ in range(k)) for k in lengths]


def _perturb_lora(trainer: Trainer, seed: int) -> None:
    """A fresh adapter has B = 0 (a no-op); give it real weights so that LoRA changes logprobs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.params.items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@contextlib.contextmanager
def _threads(n: int):
    """Run with n torch threads, then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _invariant_case(trainer: Trainer, prompts, max_tokens: int, seed: int, threads: tuple[int, int],
                    tally: Tally, speculative: dict) -> dict:
    sampler_model = InvariantLM(copy.deepcopy(trainer.hf_model), trainer.model.compute)  # a published copy
    sampler_model.routing = RoutingLog()
    drafter = make_drafter(speculative["drafter"], target=sampler_model, tokenizer=trainer.tokenizer)
    sampler = Sampler(sampler_model, trainer.tokenizer, drafter=drafter, draft_tokens=speculative["draft_tokens"])
    params = SamplingParams(max_tokens=max_tokens, seed=seed, stop=())
    # With speculation, every other prompt decodes greedily: an untrained model's samples at
    # temperature 1 are noise that no drafter predicts, and the check must see drafts accepted too.
    greedy = SamplingParams(max_tokens=max_tokens, seed=seed, stop=(), temperature=0.0)
    with _threads(threads[0]):
        results = sampler.sample([SampleRequest(p, greedy if speculative["drafter"] != "off" and i % 2 else params)
                                  for i, p in enumerate(prompts)])
    data, sampled = [], []
    for p, r in zip(prompts, results):
        seq = r.sequences[0]
        full = list(p) + list(seq.tokens)
        weights = [0.0] * (len(p) - 1) + [1.0] * len(seq.tokens)
        data.append(Datum.from_tokens(full, weights))
        sampled.append(torch.tensor(seq.logprobs, dtype=torch.float32))
    with _threads(threads[1]):
        out = trainer.forward(data)
    trained = [torch.from_numpy(o["logprobs"][len(p) - 1 :]) for o, p in zip(out.loss_fn_outputs, prompts)]
    n, eq, mx = tally.add(torch.cat(sampled), torch.cat(trained))
    routing = _routing_agreement(trainer, sampler_model.routing, [list(d.model_input) + [int(d.loss_fn_inputs[
        "target_tokens"][-1])] for d in data], prompts, threads[1])
    tally.routing_compared += routing[0]
    tally.routing_equal += routing[1]
    if hasattr(drafter, "close"):
        drafter.close()
    speculative["drafted"] += sampler.spec_stats.drafted
    speculative["accepted"] += sampler.spec_stats.accepted
    return {"tokens": n, "equal": eq, "max_abs_diff": mx, "routing_compared": routing[0], "routing_equal": routing[1]}


def _routing_agreement(trainer: Trainer, sampled: RoutingLog, seqs, prompts, threads: int) -> tuple[int, int]:
    """(expert choices compared, equal): every MoE layer's top-k experts for every token the
    sampler fed (the prompt in its prefill, each new token in its decode step) against the
    trainer's full-sequence forward of the same sequence. (0, 0) for a dense model.

    The sampler's rows here are the prompts in order, none finishes early (no stops), so decode
    call s holds each row's token at position len(prompt) + s - 1."""
    if not sampled.calls or not sampled.calls[0]:
        return 0, 0
    trained = RoutingLog()
    trainer.model.routing = trained
    try:
        tokens = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        for i, q in enumerate(seqs):
            tokens[i, : len(q)] = torch.tensor(q)
        with torch.no_grad(), _threads(threads):
            trainer.model.hidden_states(tokens)
    finally:
        trainer.model.routing = None
    full = trained.calls[0]
    compared = equal = 0
    for layer, train_BTK in full.items():
        for i, p in enumerate(prompts):
            fed = [sampled.calls[0][layer][i, : len(p)]]  # the prefill
            fed += [call[layer][i, 0:1] for call in sampled.calls[1:]]  # one token per decode step
            mine = torch.cat(fed)
            other = train_BTK[i, : len(mine)]
            compared += mine.numel()
            equal += int((mine == other).sum())
    return compared, equal


def _hf_case(hf_model, prompts, max_tokens: int, seed: int, pad_id: int, tally: Tally) -> dict:
    """Plain transformers: generate (left-padded, KV cache) vs a right-padded full forward."""
    B, T = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, T), pad_id)
    att = torch.zeros(B, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = torch.tensor(p)
        att[i, T - len(p) :] = 1
    torch.manual_seed(seed)
    with torch.no_grad():
        gen = hf_model.generate(
            input_ids=ids, attention_mask=att, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=max_tokens, min_new_tokens=max_tokens, output_logits=True,
            return_dict_in_generate=True, pad_token_id=pad_id,
        )
        new = gen.sequences[:, T:]
        logits = torch.stack(gen.logits, dim=1).float()
        sampled = torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        L = T + max_tokens
        full = torch.full((B, L), pad_id)
        fatt = torch.zeros(B, L, dtype=torch.long)
        for i, p in enumerate(prompts):
            seq = list(p) + new[i].tolist()
            full[i, : len(seq)] = torch.tensor(seq)
            fatt[i, : len(seq)] = 1
        lp = torch.log_softmax(hf_model(input_ids=full, attention_mask=fatt).logits.float(), -1)
        trained = torch.stack([
            lp[i, len(p) - 1 : len(p) - 1 + max_tokens].gather(-1, new[i].unsqueeze(-1)).squeeze(-1)
            for i, p in enumerate(prompts)
        ])
    n, eq, mx = tally.add(sampled.flatten(), trained.flatten())
    return {"tokens": n, "equal": eq, "max_abs_diff": mx}


def is_moe(model_dir: str) -> bool:
    from lockstep.engine.loading import read_config

    return read_config(model_dir).get("model_type") in ("qwen3_moe", "mixtral")


def run(model_dir: str, *, seed: int = 0, max_tokens: int = 16, lora_rank: int = 8, speculative: str = "off",
        draft_tokens: int = 4, compute: Compute = Compute(), batch_sizes: tuple[int, ...] = BATCH_SIZES) -> dict:
    """Run the workload; return the summary dict (see module docstring). `compute`: the device and
    dtype of both sides (the transformers comparison runs in the same); `batch_sizes`: fewer or
    smaller batches for a smoke run (Triton's interpreter on a CPU)."""
    if speculative not in DRAFTERS:  # an unknown name fails before any work
        raise EngineError(f"unknown drafter {speculative!r}; choose one of {', '.join(DRAFTERS)}")
    spec = {"drafter": speculative, "draft_tokens": draft_tokens, "drafted": 0, "accepted": 0}
    rng = random.Random(seed)
    ours, hf = Tally(), Tally()
    moe = is_moe(model_dir)
    for lora_on in (False,) if moe else (False, True):  # (LoRA on a mixture of experts: not supported)
        trainer = Trainer.from_pretrained(model_dir, lora=LoraSpec(rank=lora_rank, seed=seed) if lora_on else None,
                                          compute=compute)
        if lora_on:
            _perturb_lora(trainer, seed)
        plain = copy.deepcopy(trainer.hf_model).to(compute.torch_dtype)
        pad = trainer.tokenizer.pad_token_id if trainer.tokenizer.pad_token_id is not None else 0
        for bs in batch_sizes:
            prompts = _prompts(rng, bs, trainer.vocab_size)
            case = {"lora": lora_on, "batch": bs}
            for threads in THREADS:
                result = _invariant_case(trainer, prompts, max_tokens, seed + bs, threads, ours, spec)
                ours.cases.append({**case, "threads": list(threads), **result})
            with compute.scope():
                hf.cases.append({**case, **_hf_case(plain, prompts, max_tokens, seed + bs, pad, hf)})
    from lockstep.engine.invariant import MKL_MODE

    return {**ours.summary(), "moe": moe, "path": trainer.model.path, "path_reason": trainer.model.path_reason,
            "device": compute.device, "dtype": compute.dtype, "mkl_mode": MKL_MODE, "speculative": spec, "cases": ours.cases, "hf": {**hf.summary(), "cases": hf.cases}}


# -- many tenants on one base ---------------------------------------------------------------------
TENANT_SHAPES = ((4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")),
                 (1, ("q_proj", "v_proj")), (8, ("o_proj", "down_proj", "lm_head")),
                 (2, ("gate_proj", "up_proj", "k_proj")), (16, ("q_proj", "k_proj", "v_proj", "o_proj")))
"""Rank and target projections of tenant i (cycled): ranks and target sets differ between tenants;
tenant 0 has the Tinker SDK's default set (every projection and lm_head)."""
TENANT_LOSSES = (("cross_entropy", None), ("importance_sampling", None),
                 ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}))
"""Tenant i's loss (cycled): each model's loss and its normalisation run on its own datums."""


def run_tenants(model_dir: str, *, tenants: int = 4, seed: int = 0, max_tokens: int = 8, speculative: str = "off",
                draft_tokens: int = 4, compute: Compute = Compute()) -> dict:
    """`check consistency --tenants K`: K LoRA adapters (ranks and targets from TENANT_SHAPES) on one
    shared base, plus rows on the bare base. Sampler: every tenant's requests alone, then all of
    them in one call, interleaved at random (at another thread count); every token and logprob
    must be equal. Trainer: each model's forward and forward_backward alone, then packed in one
    call (groups in random order): logprobs, losses, metrics and adapter gradients must be equal,
    and the packed logprobs of the sampled tokens must equal the sampler's. Returns the counts."""
    from lockstep.engine.adapters import SharedBase

    if not isinstance(tenants, int) or tenants < 1:
        raise EngineError(f"tenants must be an integer >= 1, got {tenants!r}")
    if speculative not in DRAFTERS:
        raise EngineError(f"unknown drafter {speculative!r}; choose one of {', '.join(DRAFTERS)}")
    rng = random.Random(seed)
    base = SharedBase.from_pretrained(model_dir, compute=compute)
    trainers = [_tenant(base, i, seed) for i in range(tenants)]
    drafter = make_drafter(speculative, target=base.model, tokenizer=base.tokenizer)
    sampler = Sampler(base.model, base.tokenizer, drafter=drafter, draft_tokens=draft_tokens)
    owners = [t.snapshot() for t in trainers] + [None]  # the last: rows on the bare base
    requests = [_tenant_requests(rng, i, a, base.vocab_size, max_tokens, greedy=speculative != "off")
                for i, a in enumerate(owners)]
    with _threads(1):
        alone = [sampler.sample(reqs) for reqs in requests]
    order = [(i, j) for i, reqs in enumerate(requests) for j in range(len(reqs))]
    rng.shuffle(order)
    with _threads(2):
        mixed = sampler.sample([requests[i][j] for i, j in order])
    packed_of = {pos: r for pos, r in zip(order, mixed)}
    sampled = Tally()
    for i, results in enumerate(alone):
        for j, r in enumerate(results):
            for a, b in zip(r.sequences, packed_of[(i, j)].sequences):
                same = len(a.tokens) == len(b.tokens) and all(x == y for x, y in zip(a.tokens, b.tokens))
                lp = torch.tensor(a.logprobs) if same else torch.zeros(len(a.tokens))
                sampled.add(lp, torch.tensor(b.logprobs) if same else torch.ones(len(a.tokens)))
    if hasattr(drafter, "close"):
        drafter.close()
    groups = [_tenant_group(rng, t, i, requests[i], alone[i]) for i, t in enumerate(trainers)]
    trainer_report, against_sampler = _packed_vs_alone(base, groups, rng, requests, alone)
    shared = sum(plan_prefixes([tuple(d.model_input) for d in g[3]]) is not None for g in groups)
    ok = (sampled.equal == sampled.compared and against_sampler.equal == against_sampler.compared
          and all(v["equal"] == v["compared"] for part in trainer_report.values() for v in part.values()))
    return {"tenants": tenants, "path": base.model.path, "path_reason": base.model.path_reason,
            "device": compute.device, "dtype": compute.dtype,
            "adapters": [{"rank": t.lora.rank, "targets": list(t.lora.target_modules), "loss": g[1]}
                         for t, g in zip(trainers, groups)],
            "sampler": {"tokens_compared": sampled.compared, "tokens_bitwise_equal": sampled.equal,
                        "rows": sum(r.num_samples for reqs in requests for r in reqs)},
            "trainer": trainer_report,
            "prefix_groups": shared,
            "sampler_vs_trainer": {"tokens_compared": against_sampler.compared,
                                   "tokens_bitwise_equal": against_sampler.equal},
            "speculative": {"drafter": speculative, "drafted": sampler.spec_stats.drafted,
                            "accepted": sampler.spec_stats.accepted},
            "ok": ok}


def _tenant(base, i: int, seed: int):
    """Tenant i's adapter: its shape from TENANT_SHAPES (the rank capped at the base's limit), B drawn
    away from 0 so that it changes logprobs."""
    from lockstep.engine.adapters import AdapterTrainer

    rank, targets = TENANT_SHAPES[i % len(TENANT_SHAPES)]
    limit = min(min(base.shapes[k]) for k in base.shapes if k[1] in targets)
    trainer = AdapterTrainer(base, LoraSpec(rank=min(rank, limit), alpha=2.0 * rank, target_modules=targets,
                                            seed=seed + i), name=f"tenant{i}")
    g = torch.Generator().manual_seed(seed * 1000 + i)
    with torch.no_grad():
        for name, p in trainer.params.items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return trainer


def _tenant_requests(rng: random.Random, i: int, adapter, vocab: int, max_tokens: int, greedy: bool) -> list:
    """A tenant's requests: prompts of several lengths, one sampled three times (a shared prompt for
    the trainer's prefix path), different max_tokens (rows finish apart), greedy ones when
    speculating (so that drafts are accepted on an untrained model)."""
    out = []
    for j, n in enumerate(rng.sample((1, 3, 9, 17, 30), 3)):
        prompt = tuple(rng.randrange(4, vocab) for _ in range(max(n, 9) if j == 0 else n))
        params = SamplingParams(max_tokens=max(1, max_tokens - (i + j) % 3), seed=rng.randrange(1 << 30), stop=(),
                                temperature=0.0 if greedy and j % 2 else 1.0)
        out.append(SampleRequest(prompt, params, num_samples=3 if j == 0 else 1, adapter=adapter))
    return out


def _tenant_group(rng: random.Random, trainer, i: int, requests, results) -> tuple:
    """(trainer, loss, config, datums): the tenant's samples as datums of its loss."""
    loss, config = TENANT_LOSSES[i % len(TENANT_LOSSES)]
    data = []
    for req, res in zip(requests, results):
        for seq in res.sequences:
            p = list(req.prompt)
            full = p + list(seq.tokens)
            n = len(full) - 1
            extra = {}
            if loss != "cross_entropy":
                extra = {"logprobs": [0.0] * (len(p) - 1) + list(seq.logprobs),
                         "advantages": [0.0] * (len(p) - 1) + [rng.uniform(-1, 1)] * len(seq.tokens)}
            data.append(Datum.from_tokens(full, [0.0] * (len(p) - 1) + [1.0] * (n - len(p) + 1), **extra))
    return trainer, loss, config, tuple(data)


def _packed_vs_alone(base, groups, rng: random.Random, requests, alone) -> tuple[dict, Tally]:
    """Forward and forward_backward of each model alone, then packed; counts of equal bits."""
    from lockstep.engine.packed import packed_forward, packed_forward_backward
    from lockstep.engine.types import TrainGroup

    report = {}
    order = list(range(len(groups)))
    rng.shuffle(order)
    specs = [TrainGroup(t, data, loss, config) for t, loss, config, data in groups]
    for kind in ("forward", "forward_backward"):
        solo, grads = [], []
        for (t, loss, config, data) in groups:
            solo.append(getattr(t, kind)(data, loss, config))
            grads.append({n: p.grad.clone() for n, p in t.params.items() if p.grad is not None})
            t.zero_grad()
        run = packed_forward_backward if kind == "forward_backward" else packed_forward
        out = run(base, [specs[k] for k in order])
        mixed = {k: r for k, r in zip(order, out)}
        counts = {name: Tally() for name in ("logprobs", "losses", "metrics") + (("grads",) if kind != "forward" else ())}
        for k, (t, *_rest) in enumerate(groups):
            a, b = solo[k], mixed[k]
            if isinstance(b, Exception):
                raise b
            counts["logprobs"].add(*(torch.cat([torch.from_numpy(o["logprobs"]) for o in r.loss_fn_outputs])
                                     for r in (a, b)))
            counts["losses"].add(torch.tensor([a.metrics["loss:sum"]]), torch.tensor([b.metrics["loss:sum"]]))
            counts["metrics"].compared += 1
            counts["metrics"].equal += int(a.metrics == b.metrics)
            if kind == "forward":
                continue
            now = {n: p.grad for n, p in t.params.items() if p.grad is not None}
            counts["grads"].compared += sum(g.numel() for g in grads[k].values())
            if set(now) == set(grads[k]):
                counts["grads"].equal += sum(int((g.view(torch.int32) == now[n].view(torch.int32)).sum())
                                             for n, g in grads[k].items())
            t.zero_grad()
        report[kind] = {name: {"compared": c.compared, "equal": c.equal} for name, c in counts.items()}
        if kind == "forward":
            against = _against_sampler(out, order, requests, alone)
    return report, against


def _against_sampler(out, order, requests, alone) -> Tally:
    """The packed trainer's logprob of every sampled token against the sampler's."""
    tally = Tally()
    for k, r in zip(order, out):
        outputs = iter(r.loss_fn_outputs)
        for req, res in zip(requests[k], alone[k]):
            for seq in res.sequences:
                lp = next(outputs)["logprobs"][len(req.prompt) - 1:]
                tally.add(torch.tensor(seq.logprobs, dtype=torch.float32), torch.from_numpy(lp))
    return tally
