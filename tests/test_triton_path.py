"""The engine on its CUDA path (the Triton kernels), run on CPU tensors under Triton's interpreter
(conftest.py sets TRITON_INTERPRET=1): the sampler's logprobs equal the trainer's bit for bit in
float32 and bfloat16, with LoRA too; a sample does not depend on its batch; training works through
the same kernels with float32 master weights; a checkpoint round trip keeps the bits.

A micro model keeps the interpreter (numpy per program) to seconds per case."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lockstep.engine.device import Compute
from lockstep.engine.sampler import Sampler
from lockstep.engine.trainer import Trainer
from lockstep.engine.types import AdamParams, Datum, LoraSpec, SampleRequest, SamplingParams

PROMPTS = [(5, 6, 7, 8), (9, 10), (11, 12, 13, 14, 15, 16, 17, 18, 19)]


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory):
    from lockstep.engine.tiny import save_model_dir, tiny_config

    cfg = tiny_config(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    return str(save_model_dir(tmp_path_factory.mktemp("micro"), cfg, seed=3))


def triton_trainer(model_dir, dtype: str, lora: LoraSpec | None = None) -> Trainer:
    trainer = Trainer.from_pretrained(model_dir, lora=lora, compute=Compute("cpu", dtype, kernels="triton"))
    assert trainer.model.path == "triton"
    if lora is not None:  # a fresh adapter's B is 0 (a no-op): give it weights that change logprobs
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in trainer.params.items():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return trainer


def sample(trainer, prompts, max_tokens=6):
    sampler = Sampler(trainer.model, trainer.tokenizer)
    reqs = [SampleRequest(p, SamplingParams(max_tokens=max_tokens, seed=sum(p), stop=())) for p in prompts]
    return sampler.sample(reqs)


def datums(prompts, results) -> list[Datum]:
    out = []
    for p, r in zip(prompts, results):
        seq = r.sequences[0]
        out.append(Datum.from_tokens(list(p) + list(seq.tokens), [0.0] * (len(p) - 1) + [1.0] * len(seq.tokens)))
    return out


def trainer_logprobs(trainer, prompts, results) -> list[np.ndarray]:
    out = trainer.forward(datums(prompts, results))
    return [o["logprobs"][len(p) - 1:] for o, p in zip(out.loss_fn_outputs, prompts)]


@pytest.mark.parametrize("dtype, lora", [("float32", None), pytest.param("bfloat16", None, marks=pytest.mark.slow),
                                         pytest.param("bfloat16", LoraSpec(rank=4, seed=2), marks=pytest.mark.slow)])
def test_sampler_and_trainer_agree_bit_for_bit(micro_dir, dtype, lora):
    trainer = triton_trainer(micro_dir, dtype, lora)
    results = sample(trainer, PROMPTS)
    for r, trained in zip(results, trainer_logprobs(trainer, PROMPTS, results)):
        sampled = np.asarray(r.sequences[0].logprobs, dtype=np.float32)
        assert sampled.shape == trained.shape == (6,)
        assert np.array_equal(sampled.view(np.uint32), trained.view(np.uint32))
    alone = sample(trainer, PROMPTS[1:2])  # the middle prompt without its neighbours: the same sample
    assert alone[0].sequences[0] == results[1].sequences[0]


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_bf16_computes_in_bf16_over_float32_master_weights(micro_dir):
    t16, t32 = triton_trainer(micro_dir, "bfloat16"), triton_trainer(micro_dir, "float32")
    assert all(p.dtype == torch.float32 for p in t16.params.values())  # what the optimizer steps
    r = sample(t32, PROMPTS)
    lp16, lp32 = trainer_logprobs(t16, PROMPTS, r), trainer_logprobs(t32, PROMPTS, r)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(lp16, lp32))
    assert 0 < diff < 0.1  # bf16 rounding shows, and stays small on a random micro model


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_training_on_the_triton_path_matches_the_cpu_kernels(micro_dir):
    """float32: the Triton path's loss and gradients agree with the CPU path's to rounding (their
    kernels sum in other orders), and steps lower the loss."""
    data = [Datum.from_tokens([4 + (7 * i + j) % 40 for j in range(12)]) for i in range(3)]
    tri, cpu = triton_trainer(micro_dir, "float32"), Trainer.from_pretrained(micro_dir)
    a, b = tri.forward_backward(data, "cross_entropy"), cpu.forward_backward(data, "cross_entropy")
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
    for name, p in tri.params.items():
        torch.testing.assert_close(p.grad, cpu.params[name].grad, rtol=1e-4, atol=1e-5)
    tri.zero_grad()
    losses = []
    for _ in range(4):
        losses.append(tri.forward_backward(data, "cross_entropy").metrics["loss:sum"])
        tri.optim_step(AdamParams(learning_rate=1e-2))
    assert losses[-1] < losses[0]


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_checkpoint_round_trip_keeps_the_bits(micro_dir, tmp_path):
    trainer = triton_trainer(micro_dir, "bfloat16")
    data = [Datum.from_tokens(list(p) + [20, 21, 22]) for p in PROMPTS]
    trainer.forward_backward(data, "cross_entropy")
    trainer.optim_step(AdamParams(learning_rate=1e-2))
    trainer.save_state(tmp_path / "ckpt")
    before = trainer.forward(data).loss_fn_outputs
    again = Trainer.from_state(tmp_path / "ckpt", compute=Compute("cpu", "bfloat16", kernels="triton"))
    after = again.forward(data).loss_fn_outputs
    assert all(np.array_equal(x["logprobs"], y["logprobs"]) for x, y in zip(before, after))
    assert again.step == 1 and again.model.path == "triton"


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), *[pytest.param(*c, marks=pytest.mark.slow) for c in [
    ("qwen3", "float32"), ("qwen3_moe", "float32"), ("mixtral", "float32"), ("qwen3_moe", "bfloat16")]]])
def test_every_architecture_on_the_triton_path(arch, dtype, arch_dirs):
    """Llama, Qwen3 (per-head q/k norms, head size 24: a padded head block) and the mixtures of
    experts: the Triton path computes transformers' float32 forward (to float32 rounding, or to bf16
    rounding in bf16), and its sampler and trainer agree bit for bit."""
    trainer = triton_trainer(arch_dirs[arch], dtype)
    seq = [5 + (11 * i) % 200 for i in range(20)]
    with torch.no_grad():
        ours = trainer.forward([Datum.from_tokens(seq)]).loss_fn_outputs[0]["logprobs"]
        ref = torch.log_softmax(trainer.hf_model(torch.tensor([seq])).logits[0, :-1], -1)
    want = ref.gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1).numpy()
    err = np.abs(ours - want)
    if dtype == "float32":
        assert err.max() < 1e-4
    else:  # bf16 rounds each op to 8 bits (logits here span ~15 nats); a wrong forward is off by nats
        assert err.max() < 0.5 and err.mean() < 0.1
    prompts = PROMPTS[:2]
    results = sample(trainer, prompts, max_tokens=4)
    for r, trained in zip(results, trainer_logprobs(trainer, prompts, results)):
        assert np.array_equal(np.asarray(r.sequences[0].logprobs, dtype=np.float32).view(np.uint32), trained.view(np.uint32))


class AtomicOrder(TorchDispatchMode):
    """Runs every scatter-add as CUDA may: `index_add` whose destinations repeat adds each
    destination's terms in a shuffled order (seeded), as atomics land in whatever order the GPU's
    threads reach them. Any other accumulating scatter (scatter_add, index_put with accumulate,
    put_, scatter_reduce) with a repeated destination fails the test: it would be a new
    nondeterministic reduction on the CUDA path, not modelled here."""

    ACCUMULATING = {"aten::scatter_add", "aten::scatter_add_", "aten::scatter_reduce", "aten::scatter_reduce_",
                    "aten::put", "aten::put_"}

    def __init__(self, seed: int):
        super().__init__()
        self.rng = torch.Generator().manual_seed(seed)
        self.shuffled = 0
        """index_adds whose destinations repeated (the reductions the shuffle reorders)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in ("aten::index_add", "aten::index_add_"):
            return self._index_add(func, *args, **kwargs)
        if name in self.ACCUMULATING or (name.startswith(("aten::index_put", "aten::_index_put_impl"))
                                         and (args[3] if len(args) > 3 else kwargs.get("accumulate", False))):
            assert not _repeats(name, args), f"{name} adds into a repeated destination: nondeterministic on CUDA"
        return func(*args, **kwargs)

    def _index_add(self, func, target, dim, index, source, *, alpha=1):
        if index.unique().numel() == index.numel():  # one term per destination: any order, same bits
            return func(target, dim, index, source, alpha=alpha)
        self.shuffled += 1
        out = target if func._schema.name.endswith("_") else target.clone()
        rows, terms = out.movedim(dim, 0), (source * alpha).movedim(dim, 0)
        for i in torch.randperm(index.numel(), generator=self.rng).tolist():
            rows[index[i]] += terms[i]
        return out


def _repeats(name: str, args) -> bool:
    """Whether an accumulating scatter writes some destination twice (scatter_add: the index's
    full coordinates; anything else is assumed to)."""
    if name.startswith("aten::scatter_add"):
        target, dim, index = args[0], args[1], args[2]
        coords = list(torch.meshgrid(*(torch.arange(n) for n in index.shape), indexing="ij"))
        coords[dim] = index
        flat = sum(c * stride for c, stride in zip(coords, target.stride()))
        return flat.unique().numel() != flat.numel()
    return True


def group_datums(prompt: tuple[int, ...], completions: list[list[int]], seed: int) -> list[Datum]:
    """A GRPO group: completions of one prompt, with the loss inputs of the policy-gradient losses."""
    g = np.random.default_rng(seed)
    out = []
    for c in completions:
        n = len(prompt) + len(c) - 1
        mask = [0.0] * (len(prompt) - 1) + [1.0] * len(c)  # the completion forms GSPO's sequence ratio
        out.append(Datum.from_tokens(list(prompt) + c, mask, sequence_ratio_mask=mask,
                                     logprobs=-g.uniform(0.5, 3.0, n).astype(np.float32),
                                     advantages=np.full(n, g.normal(), np.float32)))
    return out


def test_atomic_order_changes_the_bits_of_an_index_add_gradient():
    """Control: under AtomicOrder, the gradient of a row copied several times (index_select's
    backward: index_add) takes other bits for another order, as on a GPU; through copy_rows (the
    shared prefixes' copy) it does not."""
    from lockstep.engine.rows import copy_rows

    x, rows = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)), [0, 2, 0, 0, 1, 0, 2, 0]
    weights = torch.randn(len(rows), 64, generator=torch.Generator().manual_seed(1))

    def grad(copy, seed):
        leaf = x.clone().requires_grad_(True)
        with AtomicOrder(seed) as mode:
            (copy(leaf) * weights).sum().backward()
        return leaf.grad, mode.shuffled

    plain = [grad(lambda t: t.index_select(0, torch.tensor(rows)), seed) for seed in (1, 2)]
    assert plain[0][1] == plain[1][1] == 1 and not torch.equal(plain[0][0], plain[1][0])
    fixed = [grad(lambda t: copy_rows(t, rows), seed) for seed in (1, 2)]
    assert fixed[0][1] == fixed[1][1] == 0 and torch.equal(fixed[0][0], fixed[1][0])
    assert torch.equal(fixed[0][0], x.new_zeros(3, 64).index_add_(0, torch.tensor(rows), weights))  # CPU's order


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_data_parallel_step_is_one_trainer_whatever_order_the_gpus_atomics_take(micro_dir):
    """Two micro-batches of GRPO groups (shared prompts: the trainer shares their prefixes) under
    GSPO (per-datum sums over tokens). One trainer accumulates both under one atomic order; two
    'ranks' compute one each under others and sum them in micro-batch order, as
    engine/data_parallel.py does. The gradients are the same bits: no reduction on the CUDA path
    depends on the order atomics land in."""
    loss = "gspo"
    from lockstep.engine.prefix import plan_prefixes

    parts = [group_datums((5, 6, 7, 8, 9, 10), [[11, 12, 13], [14, 15], [16, 17, 18, 19], [20, 21]], seed=1),
             group_datums((22, 23, 24, 25, 26), [[27, 28], [29, 30, 31], [32, 33, 34]], seed=2)]
    assert all(plan_prefixes([d.model_input for d in part]) is not None for part in parts)  # shared prefixes
    trainer = triton_trainer(micro_dir, "float32")
    with AtomicOrder(seed=0):
        for part in parts:
            trainer.forward_backward(part, loss)
    one = {n: p.grad.clone() for n, p in trainer.params.items()}
    trainer.zero_grad()
    ranks = []
    for seed, part in ((1, parts[0]), (2, parts[1])):
        with AtomicOrder(seed):
            trainer.forward_backward(part, loss)
        ranks.append({n: p.grad.clone() for n, p in trainer.params.items()})
        trainer.zero_grad()
    for name, g in one.items():
        chained = ranks[0][name] + ranks[1][name]
        assert torch.equal(chained, g), f"{name}: max |diff| {float((chained - g).abs().max()):.3g}"
