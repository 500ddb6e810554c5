"""Many LoRA tenants on one shared frozen base (engine/adapters.py, engine/multi_lora.py,
engine/packed.py): what a tenant gets packed with others is, bit for bit, what it gets alone, in
the sampler (speculative or not) and the trainer; a hostile co-tenant cannot move another's bits;
the LoRA state, exports and checkpoints are the peft-wrapped Trainer's.

The fused CPU path runs here; the eager fallback through the gate's subprocess
(tests/test_consistency_cli.py), the Triton path under the interpreter at the end."""

import dataclasses
import json
import random

import numpy as np
import pytest
import torch

from lockstep.engine.adapters import AdapterTrainer, SharedBase
from lockstep.engine.device import Compute
from lockstep.engine.drafters import make_drafter
from lockstep.engine.packed import packed_forward, packed_forward_backward
from lockstep.engine.sampler import Sampler
from lockstep.engine.trainer import Trainer
from lockstep.engine.types import (AdamParams, AdapterAssignment, Datum, EngineError, LoraSpec, SampleRequest,
                                   SamplingParams, TrainGroup)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT = ALL + ("lm_head",)
"""The Tinker SDK's default LoRA (train_attn, train_mlp and train_unembed)."""
SHAPES = [(4, DEFAULT), (1, ("q_proj", "v_proj")), (8, ("o_proj", "down_proj", "lm_head")),
          (2, ("gate_proj", "up_proj", "k_proj"))]
"""Tenant i's rank and targets: ranks differ, target sets from all seven and lm_head to a pair; two
tenants adapt lm_head (at ranks 4 and 8), two do not."""


def perturb(trainer, seed: int, scale: float = 0.1) -> None:
    """A fresh adapter's B is 0 (a no-op): draw it, so that each adapter changes the logprobs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.params.items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def tenant(base, i: int) -> AdapterTrainer:
    rank, targets = SHAPES[i % len(SHAPES)]
    t = AdapterTrainer(base, LoraSpec(rank=rank, alpha=16.0, target_modules=targets, seed=i), name=f"t{i}")
    perturb(t, 100 + i)
    return t


@pytest.fixture(scope="module")
def base(qwen2_dir):
    return SharedBase.from_pretrained(qwen2_dir)


@pytest.fixture(scope="module")
def tenants(base):
    return [tenant(base, i) for i in range(4)]


def bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def same_sequences(a, b) -> bool:
    """Equal tokens, stop reasons and logprobs bit for bit."""
    return len(a) == len(b) and all(x.tokens == y.tokens and x.stop_reason == y.stop_reason and
                                    np.array_equal(bits(x.logprobs), bits(y.logprobs)) for x, y in zip(a, b))


def requests_for(i: int, adapter, rng: random.Random, greedy: bool) -> list[SampleRequest]:
    """Tenant i's requests: prompts of 1 to 20 tokens, several samples of one, rows that end apart."""
    out = []
    for j in range(rng.randint(1, 3)):
        prompt = tuple(rng.randrange(4, 200) for _ in range(rng.choice((1, 4, 9, 20))))
        params = SamplingParams(max_tokens=rng.randint(3, 9), seed=rng.randrange(1 << 20), stop=(),
                                temperature=0.0 if greedy and j % 2 == 0 else 1.0)
        out.append(SampleRequest(prompt, params, num_samples=rng.randint(1, 3), adapter=adapter))
    return out


@pytest.mark.parametrize("drafter", ["off", "suffix", "model"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_row_of_a_mixed_adapter_batch_samples_what_it_samples_alone(base, tenants, drafter, seed):
    """Any mix (a random subset of tenants, rows on the bare base), order (shuffled) and batch size
    (1 to 3 requests a tenant, 1 to 3 samples each): every row's tokens and logprobs equal those of
    its tenant's requests sampled alone, with speculative decoding off or on."""
    rng = random.Random(seed)
    picked = rng.sample(range(len(tenants)), rng.randint(2, len(tenants)))
    owners = [tenants[i].snapshot() for i in picked] + [None]
    speculative = drafter != "off"
    per_owner = [requests_for(i, a, rng, speculative) for i, a in enumerate(owners)]
    options = {"train": False} if drafter == "model" else {}
    sampler = Sampler(base.model, base.tokenizer, drafter=make_drafter(drafter, target=base.model,
                                                                       tokenizer=base.tokenizer, **options))
    alone = [sampler.sample(reqs) for reqs in per_owner]
    order = [(k, j) for k, reqs in enumerate(per_owner) for j in range(len(reqs))]
    rng.shuffle(order)
    mixed = sampler.sample([per_owner[k][j] for k, j in order])
    for (k, j), result in zip(order, mixed):
        assert same_sequences(result.sequences, alone[k][j].sequences), (k, j)
    if speculative:
        assert sampler.spec_stats.accepted > 0  # drafts were verified in mixed batches too
    # Not vacuous: each adapter changes its rows (the same prompt on the bare base samples otherwise).
    probe = SampleRequest((5, 6, 7), SamplingParams(max_tokens=4, seed=3, stop=()))
    bare = sampler.sample([probe])[0].sequences[0].logprobs
    for a in owners[:-1]:
        own = sampler.sample([SampleRequest(probe.prompt, probe.params, adapter=a)])[0].sequences[0].logprobs
        assert own != bare


def datums_for(i: int, rng: random.Random, n: int, shared_prompt: bool) -> tuple[Datum, ...]:
    """n datums of 2 to 40 tokens (or sharing a 12-token prompt: the shared-prefix path), with the
    inputs every loss needs."""
    prompt = [rng.randrange(4, 200) for _ in range(12)]
    out = []
    for _ in range(n):
        body = [rng.randrange(4, 200) for _ in range(rng.choice((2, 5, 11, 40)))]
        tokens = prompt + body[:6] if shared_prompt else body
        m = len(tokens) - 1
        out.append(Datum.from_tokens(tokens, [float(rng.random() > 0.2) for _ in range(m)],
                                     logprobs=[-rng.random() * 3 for _ in range(m)],
                                     advantages=[rng.uniform(-1, 1)] * m))
    return tuple(out)


LOSSES = [("cross_entropy", None), ("importance_sampling", None),
          ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}), ("cispo", None)]


def groups_for(tenants, rng: random.Random) -> list[TrainGroup]:
    return [TrainGroup(t, datums_for(i, rng, rng.randint(1, 4), shared_prompt=i == 1), *LOSSES[i % len(LOSSES)])
            for i, t in enumerate(tenants)]


def outputs_equal(a, b) -> bool:
    return a.metrics == b.metrics and all(
        np.array_equal(bits(x[k]), bits(y[k])) for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs)
        for k in ("logprobs", "elementwise_loss")) and len(a.loss_fn_outputs) == len(b.loss_fn_outputs)


def grads_of(trainer) -> dict:
    return {n: p.grad.clone() for n, p in trainer.params.items() if p.grad is not None}


def grads_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_packed_forward_backward_gives_each_model_its_alone_loss_logprobs_and_gradients(base, tenants, seed):
    """Datums of several models in one pass (any subset and order, a shared-prefix group among
    them, each model with its own loss): each model's loss, metrics, per-token logprobs and
    adapter gradients equal its alone call's; two packed calls accumulate as two alone calls do."""
    rng = random.Random(seed)
    picked = rng.sample(tenants, rng.randint(1, len(tenants)))
    calls = [groups_for(picked, rng) for _ in range(2)]
    alone_out, alone_grads = [], []
    for t in picked:
        t.zero_grad()
    for groups in calls:  # alone: one model at a time, twice (gradients accumulate)
        alone_out.append([g.model.forward_backward(g.data, g.loss_fn, g.loss_fn_config) for g in groups])
    alone_grads = [grads_of(t) for t in picked]
    for t in picked:
        t.zero_grad()
    for groups, expected in zip(calls, alone_out):
        order = list(range(len(groups)))
        rng.shuffle(order)
        packed = packed_forward_backward(base, [groups[k] for k in order])
        for k, result in zip(order, packed):
            assert outputs_equal(result, expected[k]), (seed, k)
    for t, expected in zip(picked, alone_grads):
        assert grads_equal(grads_of(t), expected)
        assert any(bool(g.abs().sum() > 0) for g in expected.values())
        t.zero_grad()


def test_packed_forward_equals_forward_alone_and_takes_rows_on_the_bare_base(base, tenants):
    rng = random.Random(7)
    groups = groups_for(tenants, rng)
    bare = TrainGroup(None, datums_for(9, rng, 3, shared_prompt=False))
    alone = [g.model.forward(g.data, g.loss_fn, g.loss_fn_config) for g in groups]
    packed = packed_forward(base, [groups[2], bare, groups[0], groups[3], groups[1]])
    for k, result in zip((2, 0, 3, 1), [packed[0], *packed[2:]]):
        assert outputs_equal(result, alone[k])
    bare_alone = packed_forward(base, [bare])[0]
    assert outputs_equal(packed[1], bare_alone)
    assert all(p.grad is None for t in tenants for p in t.params.values())  # forward touches no gradient
    fb = tenants[0].forward_backward(groups[0].data, groups[0].loss_fn)  # and forward_backward's logprobs agree
    tenants[0].zero_grad()
    for x, y in zip(fb.loss_fn_outputs, alone[0].loss_fn_outputs):
        assert np.array_equal(bits(x["logprobs"]), bits(y["logprobs"]))


def test_packed_rows_past_a_models_own_length_take_no_part_in_its_gradient(base, tenants):
    """The per-group token limit: a model packed with longer datums of another keeps its alone
    gradient; the same forward with the adapter on the padding rows too (tokens=None) is the
    control that shows the limit is what keeps it (on this CPU's MKL, a longer reduction over
    zero rows changes bits; if it ever does not, the control says so)."""
    t = tenants[0]
    short = (Datum.from_tokens([5, 6, 7, 8, 9]),)
    long = (Datum.from_tokens(list(range(4, 60))),)

    def grad_with(tokens):
        t.zero_grad()
        model = base.model
        rows = torch.zeros(2, 56, dtype=torch.long)
        rows[0, :4] = torch.tensor([5, 6, 7, 8])
        rows[1] = torch.arange(4, 60)
        with torch.enable_grad():
            hidden = model.hidden_states(rows, adapters=AdapterAssignment((t.adapter,), (0, -1), tokens))
            lp = model.logprobs_of(hidden[0, :4], torch.tensor([6, 7, 8, 9]), AdapterAssignment((t.adapter,), (0,) * 4))
            (-lp).sum().backward()  # cross_entropy's loss: -log p
        return grads_of(t)

    alone = t.forward_backward(short, "cross_entropy")
    expected = grads_of(t)
    assert float(alone.metrics["loss:sum"]) > 0
    assert grads_equal(grad_with((4, 0)), expected)
    packed = packed_forward_backward(base, [TrainGroup(tenants[1], long), TrainGroup(t, short)])
    assert outputs_equal(packed[1], alone)
    t.zero_grad()
    tenants[1].zero_grad()
    assert grads_equal(grad_with((4, 0)), expected)
    unlimited = grad_with(None)
    t.zero_grad()
    assert all(torch.allclose(unlimited[n], expected[n], rtol=1e-4, atol=1e-7) for n in expected)  # the same maths


def hostile(base, spec: LoraSpec, value: float) -> AdapterTrainer:
    h = AdapterTrainer(base, spec, name="hostile")
    with torch.no_grad():
        for p in h.params.values():
            p.fill_(value)
    return h


@pytest.mark.parametrize("value", [1e30, float("nan")])
def test_a_hostile_cotenant_cannot_change_another_tenants_samples_or_gradients(base, tenants, value):
    """Extreme (1e30) or NaN adapter weights and a long request in the same batch: the victim's
    tokens, logprobs, loss and gradients are its alone bits; the hostile group's non-finite loss
    fails that group alone and leaves its gradients untouched. Control: the attack is real (the
    hostile rows' own logprobs are not finite)."""
    victim = tenants[0]
    evil = hostile(base, LoraSpec(rank=8, target_modules=DEFAULT, seed=5), value)  # its lm_head's rows too
    rng = random.Random(11)
    mine = requests_for(0, victim.snapshot(), rng, greedy=False)
    theirs = [SampleRequest(tuple(range(4, 100)), SamplingParams(max_tokens=12, seed=1, stop=()), num_samples=3,
                            adapter=evil.snapshot())]
    sampler = Sampler(base.model, base.tokenizer)
    alone = sampler.sample(mine)
    mixed = sampler.sample([theirs[0], *mine, theirs[0]])
    for a, b in zip(alone, mixed[1:-1]):
        assert same_sequences(a.sequences, b.sequences)
    assert not all(np.isfinite(lp) for seq in mixed[0].sequences for lp in seq.logprobs)  # control
    data = datums_for(0, rng, 3, shared_prompt=False)
    expected = victim.forward_backward(data, "cross_entropy")
    expected_grads = grads_of(victim)
    victim.zero_grad()
    big = tuple(Datum.from_tokens(list(range(4, 200))) for _ in range(3))
    packed = packed_forward_backward(base, [TrainGroup(evil, big), TrainGroup(victim, data)])
    assert isinstance(packed[0], EngineError) and "gradients were not applied" in str(packed[0])
    assert all(p.grad is None for p in evil.params.values())
    assert outputs_equal(packed[1], expected) and grads_equal(grads_of(victim), expected_grads)
    victim.zero_grad()


def test_a_refused_group_fails_alone_and_the_others_get_their_results(base, tenants, qwen2_dir):
    rng = random.Random(3)
    good = groups_for(tenants[:2], rng)
    alone = [g.model.forward_backward(g.data, g.loss_fn, g.loss_fn_config) for g in good]
    grads = [grads_of(t) for t in tenants[:2]]
    for t in tenants:
        t.zero_grad()
    other_base = SharedBase.from_pretrained(qwen2_dir)
    stranger = AdapterTrainer(other_base, LoraSpec(rank=2))
    bad = [TrainGroup(tenants[2], (Datum.from_tokens([5, 10**6]),)),  # a token out of range
           TrainGroup(tenants[3], good[0].data, "importance_sampling", {"clip_low_threshold": 0.5}),  # config refused
           TrainGroup(None, good[0].data),  # the bare base trains nothing
           TrainGroup(stranger, good[0].data),  # bound to another base
           TrainGroup(tenants[0], good[0].data)]  # a second group of the same model
    out = packed_forward_backward(base, [good[0], *bad, good[1]])
    messages = [str(e) for e in out[1:-1]]
    assert all(isinstance(e, ValueError) for e in out[1:-1]), messages
    assert "outside" in messages[0] and "unknown config key" in messages[1] and "nothing to train" in messages[2]
    assert "another" in messages[3] or "not bound" in messages[3]
    assert "already has group 0" in messages[4]
    assert outputs_equal(out[0], alone[0]) and outputs_equal(out[-1], alone[1])
    assert grads_equal(grads_of(tenants[0]), grads[0]) and grads_equal(grads_of(tenants[1]), grads[1])
    assert [n for t in (tenants[2], tenants[3], stranger) for n, p in t.params.items() if p.grad is not None] == []
    for t in tenants:
        t.zero_grad()


@pytest.mark.parametrize("spec", [
    LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"), seed=9),
    LoraSpec(rank=4, alpha=4.0, target_modules=DEFAULT, seed=9),  # the SDK's default: lm_head too
    LoraSpec(rank=3, alpha=6.0, target_modules=("lm_head",), seed=2),  # lm_head alone
], ids=["projections", "sdk-default", "lm_head"])
def test_a_lora_trainer_built_the_old_way_and_an_adapter_on_a_shared_base_agree_bit_for_bit(base, qwen2_dir, spec):
    """Trainer(lora=spec) (a peft-wrapped private copy) and AdapterTrainer(base, spec): the same
    initial weights under peft's names, then the same logprobs and gradients (plain and
    shared-prefix batches), the same AdamW steps and the same samples. With lm_head: peft's LoRA
    of the (tied) unembedding, computed by peft's own formula on the Trainer's side."""
    agree_bit_for_bit(Trainer.from_pretrained(qwen2_dir, lora=spec), AdapterTrainer(base, spec), base)


def agree_bit_for_bit(old, new, base) -> None:
    assert list(old.params) == list(new.params)
    assert all(torch.equal(old.params[n], new.params[n]) for n in old.params)
    perturb(old, 5)
    perturb(new, 5)
    rng = random.Random(5)
    adam = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0, weight_decay=0.01)
    for shared in (False, True, False):
        data = datums_for(0, rng, 3, shared_prompt=shared)
        a, b = old.forward_backward(data, "cross_entropy"), new.forward_backward(data, "cross_entropy")
        assert outputs_equal(a, b)
        assert grads_equal(grads_of(old), grads_of(new))
        assert old.optim_step(adam) == new.optim_step(adam)
        assert all(torch.equal(old.params[n].view(torch.int32), new.params[n].view(torch.int32)) for n in old.params)
    request = SampleRequest((5, 6, 7, 8), SamplingParams(max_tokens=6, seed=4, stop=()), num_samples=2,
                            prompt_logprobs=True)
    a = Sampler(old.model, old.tokenizer).sample([request])[0]
    b = Sampler(base.model, base.tokenizer).sample([dataclasses.replace(request, adapter=new.snapshot())])[0]
    assert same_sequences(a.sequences, b.sequences)
    assert np.array_equal(bits(a.prompt_logprobs), bits(b.prompt_logprobs))


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    """A tiny Qwen2 whose lm_head is its own matrix (tie_word_embeddings false)."""
    from lockstep.engine.tiny import save_model_dir, tiny_config

    cfg = tiny_config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    cfg.tie_word_embeddings = False
    return str(save_model_dir(tmp_path_factory.mktemp("untied"), cfg, seed=4))


def test_an_lm_head_adapter_on_an_untied_base_is_the_peft_trainers_and_packs(untied_dir, tenants):
    """On a base whose lm_head is not the embeddings: the SDK's default adapter agrees with the peft
    Trainer bit for bit, and its rows sample and train packed with another lm_head tenant as alone;
    neither matrix of the base moves."""
    base = SharedBase.from_pretrained(untied_dir)
    head, embed = base.hf_model.lm_head.weight, base.hf_model.model.embed_tokens.weight
    assert head.data_ptr() != embed.data_ptr()
    before = (head.clone(), embed.clone())
    spec = LoraSpec(rank=4, alpha=4.0, target_modules=DEFAULT, seed=9)
    agree_bit_for_bit(Trainer.from_pretrained(untied_dir, lora=spec), AdapterTrainer(base, spec), base)
    ts = [AdapterTrainer(base, LoraSpec(rank=r, target_modules=targets, seed=r), name=f"u{r}")
          for r, targets in ((2, ("lm_head",)), (5, ("v_proj", "lm_head")))]
    for i, t in enumerate(ts):
        perturb(t, 40 + i)
    rng = random.Random(6)
    reqs = [requests_for(i, t.snapshot(), rng, greedy=False) for i, t in enumerate(ts)]
    sampler = Sampler(base.model, base.tokenizer)
    alone = [sampler.sample(r) for r in reqs]
    mixed = sampler.sample(reqs[1] + reqs[0])
    for a, b in zip(alone[1] + alone[0], mixed):
        assert same_sequences(a.sequences, b.sequences)
    groups = groups_for(ts, rng)
    expected = [t.forward_backward(g.data, g.loss_fn, g.loss_fn_config) for t, g in zip(ts, groups)]
    grads = [grads_of(t) for t in ts]
    for t in ts:
        t.zero_grad()
    packed = packed_forward_backward(base, groups[::-1])
    assert outputs_equal(packed[1], expected[0]) and outputs_equal(packed[0], expected[1])
    assert all(grads_equal(grads_of(t), g) for t, g in zip(ts, grads))
    assert torch.equal(head, before[0]) and torch.equal(embed, before[1])


@pytest.mark.parametrize("path", ["fused", "triton"])
def test_an_lm_head_adapter_changes_only_its_own_rows_logits(base, tenants, micro_dir, path):
    """The logits path alone, on the fused CPU kernels and the Triton kernels (interpreter, micro
    model): rows of two lm_head adapters and the bare base in one call; each row's logits are its
    alone bits (without and under autograd), the bare rows are the base's, and the adapter's
    update is real (its rows differ from the base's). Gradients of one adapter's rows' logits
    reach its lm_head factors only, bit for bit as alone."""
    if path == "triton":
        base = SharedBase.from_pretrained(micro_dir, compute=Compute("cpu", "float32", kernels="triton"))
        tenants = [tenant(base, i) for i in range(3)]
    model = base.model
    assert model.path == path
    hidden = torch.randn(7, 5, base.model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    a, b = tenants[0].snapshot(), tenants[2].snapshot()  # both adapt lm_head
    rows = (1, -1, 0, 0, 1, -1, 0)
    with torch.no_grad():
        mixed = model.logits(hidden, AdapterAssignment((a, b), rows))
        bare = model.logits(hidden)
        for r, k in enumerate(rows):
            alone = model.logits(hidden[r : r + 1], AdapterAssignment(((a, b)[k],), (0,)) if k >= 0 else None)
            assert torch.equal(mixed[r : r + 1].view(torch.int32), alone.view(torch.int32)), r
            assert torch.equal(mixed[r], bare[r]) == (k < 0), r
    t = tenants[0]
    t.zero_grad()
    with torch.enable_grad():
        alone = model.logits(hidden[[2, 3, 6]], AdapterAssignment((t.adapter,), (0, 0, 0)))
        alone.square().sum().backward()
    expected = grads_of(t)
    t.zero_grad()
    with torch.enable_grad():
        out = model.logits(hidden, AdapterAssignment((t.adapter, b), rows))
        assert torch.equal(out[[2, 3, 6]].view(torch.int32), alone.detach().view(torch.int32))
        out[[2, 3, 6]].square().sum().backward()
    got = grads_of(t)
    t.zero_grad()
    assert grads_equal(got, expected) and set(got) == {n for n in t.params if "lm_head" in n}


def test_a_snapshot_is_immutable_and_the_base_never_moves(base, tenants):
    t = tenants[3]
    before = {n: p.detach().clone() for n, p in base.hf_model.named_parameters()}
    snap = t.snapshot()
    request = SampleRequest((9, 8, 7), SamplingParams(max_tokens=5, seed=2, stop=()), adapter=snap)
    sampler = Sampler(base.model, base.tokenizer)
    first = sampler.sample([request])[0]
    saved = {n: p.detach().clone() for n, p in t.params.items()}
    t.forward_backward(datums_for(3, random.Random(1), 2, False), "cross_entropy")
    t.optim_step(AdamParams(learning_rate=0.05))
    assert sampler.sample([request])[0] == first  # the snapshot's version, whatever the trainer did since
    newer = sampler.sample([SampleRequest(request.prompt, request.params, adapter=t.snapshot())])[0]
    assert newer.sequences[0].logprobs != first.sequences[0].logprobs
    assert t.snapshot().version == snap.version + 1
    assert all(torch.equal(p, before[n]) for n, p in base.hf_model.named_parameters())
    assert not any(p.requires_grad for p in base.hf_model.parameters())
    with torch.no_grad():  # put the module-scoped tenant back
        for n, p in t.params.items():
            p.copy_(saved[n])
    t.step -= 1
    t.optimizer.state.clear()


def test_adapter_state_round_trips_bit_for_bit_and_is_a_lora_trainers_state(base, qwen2_dir, tmp_path):
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=("q_proj", "down_proj"), seed=3)
    t = AdapterTrainer(base, spec)
    rng = random.Random(2)
    adam = AdamParams(learning_rate=1e-2)
    for _ in range(2):
        t.forward_backward(datums_for(0, rng, 2, False), "cross_entropy")
        t.optim_step(adam)
    t.save_state(tmp_path / "s", data_position={"epoch": 1})
    back = AdapterTrainer.from_state(base, tmp_path / "s")
    assert back.step == 2 and back.data_position == {"epoch": 1} and back.lora == spec
    for n, p in t.params.items():
        assert torch.equal(p.view(torch.int32), back.params[n].view(torch.int32))
        for key, value in t.optimizer.state[p].items():
            assert torch.equal(value, back.optimizer.state[back.params[n]][key])
    data = datums_for(0, rng, 2, False)
    for x in (t, back):
        x.forward_backward(data, "cross_entropy")
        x.optim_step(adam)
    assert all(torch.equal(t.params[n].view(torch.int32), back.params[n].view(torch.int32)) for n in t.params)
    old = Trainer.from_state(tmp_path / "s")  # a LoRA Trainer reads the adapter's state ...
    assert old.step == 2 and all(torch.equal(old.params[n], p) for n, p in AdapterTrainer.from_state(
        base, tmp_path / "s").params.items())
    old.save_state(tmp_path / "old")  # ... and the adapter reads the Trainer's
    again = AdapterTrainer.from_state(base, tmp_path / "old")
    assert all(torch.equal(again.params[n], p) for n, p in old.params.items())
    Trainer.from_pretrained(qwen2_dir).save_state(tmp_path / "full")
    with pytest.raises(EngineError, match="full fine-tuning"):
        AdapterTrainer.from_state(base, tmp_path / "full")


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "gate_proj"), ("q_proj", "lm_head")])
def test_exports_are_the_lora_trainers_adapter_and_merged_formats(base, qwen2_dir, tmp_path, targets):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    spec = LoraSpec(rank=4, alpha=8.0, target_modules=targets, seed=1)
    old, new = Trainer.from_pretrained(qwen2_dir, lora=spec), AdapterTrainer(base, spec)
    perturb(old, 8)
    perturb(new, 8)
    for kind in ("adapter", "merged"):
        a = old.save_weights_for_sampler(tmp_path / f"old-{kind}", kind=kind)
        b = new.save_weights_for_sampler(tmp_path / f"new-{kind}", kind=kind)
        name = "adapter_model.safetensors" if kind == "adapter" else "model.safetensors"
        ta, tb = load_file(str(a / name)), load_file(str(b / name))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k].view(torch.int32), tb[k].view(torch.int32)) for k in ta)
    ca, cb = (json.loads((tmp_path / f"{w}-adapter" / "adapter_config.json").read_text()) for w in ("old", "new"))
    assert (ca["r"], ca["lora_alpha"], set(ca["target_modules"])) == (cb["r"], cb["lora_alpha"], set(cb["target_modules"]))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen2_dir), str(tmp_path / "new-adapter"))
    state = dict(loaded.named_parameters())
    assert all(torch.equal(state[n], p) for n, p in new.params.items())
    assert not any(hasattr(m, "lora_A") for m in base.hf_model.modules())  # the shared base is never wrapped


def test_a_merged_lm_head_adapter_over_tied_embeddings_unties_them(base, qwen2_dir, tmp_path):
    """The merge of an lm_head adapter on a base whose lm_head is its embeddings: lm_head becomes
    W + (B A) * scaling, the embeddings stay W, and the config says untied, from a Trainer and an
    AdapterTrainer alike (the same bytes), so the merged model loads with both matrices as exported.
    Control: peft's own merge adds the update into the one tied matrix, changing the embeddings."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("lm_head",), seed=1)
    old, new = Trainer.from_pretrained(qwen2_dir, lora=spec), AdapterTrainer(base, spec)
    perturb(old, 8)
    perturb(new, 8)
    w = base.hf_model.model.embed_tokens.weight.detach()
    f = new.adapter.factors[(-1, "lm_head")]
    head = w + (f.b.detach() @ f.a.detach()) * f.scaling
    for who, trainer in (("old", old), ("new", new)):
        out = trainer.save_weights_for_sampler(tmp_path / who, kind="merged")
        assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
        saved = load_file(str(out / "model.safetensors"))
        assert torch.equal(saved["model.embed_tokens.weight"], w) and torch.equal(saved["lm_head.weight"], head)
        loaded = AutoModelForCausalLM.from_pretrained(str(out))
        assert torch.equal(loaded.lm_head.weight, head) and torch.equal(loaded.model.embed_tokens.weight, w)
    a, b = (load_file(str(tmp_path / who / "model.safetensors")) for who in ("old", "new"))
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)
    import copy

    merged = copy.deepcopy(old.hf_model).merge_and_unload()  # control: peft's merge of the tied matrix
    assert not torch.equal(merged.model.embed_tokens.weight, w)


@pytest.mark.parametrize("spec, match", [
    (LoraSpec(rank=33), "lora rank 33 exceeds this base's limit .* at most 32"),
    (LoraSpec(rank=65, target_modules=("q_proj",)), "at most 64"),
    (LoraSpec(target_modules=("embed_tokens",)), r"\['embed_tokens'\] cannot be adapted on a shared base; choose from"),
    (LoraSpec(rank=65, target_modules=("lm_head",)), "at most 64"),
    (LoraSpec(target_modules=("q_proj", "qkv")), r"\['qkv'\] cannot be adapted"),
])
def test_an_adapter_the_base_cannot_take_is_refused_naming_the_limit(base, spec, match):
    with pytest.raises(EngineError, match=match):
        AdapterTrainer(base, spec)


def test_adapters_on_a_mixture_of_experts_base_are_refused(moe_dir):
    with pytest.raises(EngineError, match="mixture-of-experts"):
        AdapterTrainer(SharedBase.from_pretrained(moe_dir), LoraSpec(rank=2))


def test_a_sampler_row_naming_an_adapter_that_does_not_fit_is_refused_before_any_work(base, llama_dir, tenants):
    stranger = AdapterTrainer(SharedBase.from_pretrained(llama_dir), LoraSpec(rank=2, target_modules=("gate_proj",)))
    sampler = Sampler(base.model, base.tokenizer)
    ok = SampleRequest((5, 6), SamplingParams(max_tokens=2), adapter=tenants[0].snapshot())
    bad = SampleRequest((5, 6), SamplingParams(max_tokens=2), adapter=stranger.snapshot())
    with pytest.raises(EngineError, match=r"request 1 adapter .*gate_proj.* do not fit a 64 -> 128 projection"):
        sampler.sample([ok, bad])
    with pytest.raises(EngineError, match="must be an AdapterWeights"):
        sampler.sample([SampleRequest((5,), SamplingParams(max_tokens=1), adapter="t0")])
    peft_trainer = Trainer.from_pretrained(base.base_model, lora=LoraSpec(rank=2))
    with pytest.raises(EngineError, match="carries its own LoRA adapter"):
        Sampler(peft_trainer.model, peft_trainer.tokenizer).sample([ok])


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory):
    from lockstep.engine.tiny import save_model_dir, tiny_config

    cfg = tiny_config(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    return str(save_model_dir(tmp_path_factory.mktemp("micro"), cfg, seed=3))


@pytest.mark.slow  # the interpreter: ~2.5 min a dtype on 2 cores
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_the_triton_path_packed_equals_alone(micro_dir, dtype):
    """The CUDA path's kernels under Triton's interpreter (a micro model): mixed-adapter sampling and
    packed training give each tenant its alone bits, in float32 and bfloat16 (the interpreter's
    products are summed position-invariantly: triton_kernels._dot)."""
    base = SharedBase.from_pretrained(micro_dir, compute=Compute("cpu", dtype, kernels="triton"))
    assert base.model.path == "triton"
    ts = [AdapterTrainer(base, LoraSpec(rank=r, target_modules=targets, seed=r), name=f"t{r}")
          for r, targets in ((2, DEFAULT), (4, ("q_proj", "o_proj", "up_proj")))]
    for i, t in enumerate(ts):
        perturb(t, i, scale=0.2)
    rng = random.Random(4)
    owners = [t.snapshot() for t in ts] + [None]
    reqs = [[SampleRequest(tuple(rng.randrange(4, 200) for _ in range(n)), SamplingParams(max_tokens=3, seed=n, stop=()),
                           adapter=a)] for a, n in zip(owners, (2, 5, 3))]
    sampler = Sampler(base.model, base.tokenizer)
    alone = [sampler.sample(r)[0] for r in reqs]
    mixed = sampler.sample([reqs[2][0], reqs[0][0], reqs[1][0]])
    for a, b in zip(alone, [mixed[1], mixed[2], mixed[0]]):
        assert same_sequences(a.sequences, b.sequences)
    assert alone[0].sequences[0].logprobs != sampler.sample([SampleRequest(reqs[0][0].prompt, reqs[0][0].params)])[0] \
        .sequences[0].logprobs
    data = [tuple(Datum.from_tokens([rng.randrange(4, 200) for _ in range(n)]) for n in lens)
            for lens in ((3, 7), (5,))]
    expected = [t.forward_backward(d, "cross_entropy") for t, d in zip(ts, data)]
    grads = [grads_of(t) for t in ts]
    for t in ts:
        t.zero_grad()
    packed = packed_forward_backward(base, [TrainGroup(ts[1], data[1]), TrainGroup(ts[0], data[0])])
    assert outputs_equal(packed[1], expected[0]) and outputs_equal(packed[0], expected[1])
    assert all(grads_equal(grads_of(t), g) for t, g in zip(ts, grads))
