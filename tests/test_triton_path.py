"""The engine on its CUDA path (the Triton kernels), run on CPU tensors under Triton's interpreter
(conftest.py sets TRITON_INTERPRET=1): the sampler's logprobs equal the trainer's bit for bit in
float32 and bfloat16, with LoRA too; a sample does not depend on its batch; training works through
the same kernels with float32 master weights; a checkpoint round trip keeps the bits.

A micro model keeps the interpreter (numpy per program) to seconds per case."""

import numpy as np
import pytest
import torch

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


@pytest.mark.parametrize("dtype, lora", [("float32", None), ("bfloat16", None), ("bfloat16", LoraSpec(rank=4, seed=2))])
def test_sampler_and_trainer_agree_bit_for_bit(micro_dir, dtype, lora):
    trainer = triton_trainer(micro_dir, dtype, lora)
    results = sample(trainer, PROMPTS)
    for r, trained in zip(results, trainer_logprobs(trainer, PROMPTS, results)):
        sampled = np.asarray(r.sequences[0].logprobs, dtype=np.float32)
        assert sampled.shape == trained.shape == (6,)
        assert np.array_equal(sampled.view(np.uint32), trained.view(np.uint32))
    alone = sample(trainer, PROMPTS[1:2])  # the middle prompt without its neighbours: the same sample
    assert alone[0].sequences[0] == results[1].sequences[0]


def test_bf16_computes_in_bf16_over_float32_master_weights(micro_dir):
    t16, t32 = triton_trainer(micro_dir, "bfloat16"), triton_trainer(micro_dir, "float32")
    assert all(p.dtype == torch.float32 for p in t16.params.values())  # what the optimizer steps
    r = sample(t32, PROMPTS)
    lp16, lp32 = trainer_logprobs(t16, PROMPTS, r), trainer_logprobs(t32, PROMPTS, r)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(lp16, lp32))
    assert 0 < diff < 0.1  # bf16 rounding shows, and stays small on a random micro model


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


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("qwen3", "float32"), ("qwen3_moe", "float32"),
                                         ("mixtral", "float32"), ("qwen3_moe", "bfloat16")])
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
