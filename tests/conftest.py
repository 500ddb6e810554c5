"""Shared fixtures: tiny model directories built in code (no downloads)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The CUDA path's Triton kernels run here on CPU tensors, under Triton's interpreter. triton.jit reads
# the setting when it decorates a kernel (triton's own library too, checked again lazily), so it is set
# for the whole test process before anything imports triton.
os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    from lockstep.engine.tiny import save_model_dir, tiny_config

    cfg = tiny_config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    return str(save_model_dir(tmp_path_factory.mktemp("qwen2"), cfg, seed=1))


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts, 2 per token; layer 0 dense) over the character vocabulary."""
    from transformers import Qwen3MoeConfig

    from lockstep.engine.tiny import char_vocab, save_model_dir

    vocab = char_vocab()
    cfg = Qwen3MoeConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                         max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         use_sliding_window=False, bos_token_id=vocab["<bos>"], eos_token_id=vocab["<eos>"],
                         pad_token_id=vocab["<pad>"])
    return str(save_model_dir(tmp_path_factory.mktemp("moe"), cfg, seed=2))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from lockstep.engine.tiny import save_model_dir, tiny_config

    cfg = tiny_config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=160,
                      architecture="llama")
    return str(save_model_dir(tmp_path_factory.mktemp("llama"), cfg, seed=2))


@pytest.fixture(scope="session")
def builtin_dir(tmp_path_factory):
    from lockstep.engine.tiny import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("home") / "tiny"))


@pytest.fixture(scope="module", autouse=True)
def _ray_ends_with_its_module():
    """A module that left this process connected to Ray would make the next module's own
    ray.init fail ("called ray.init twice"): each module ends on no Ray."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def warm_dir(tmp_path_factory, builtin_dir):
    """The built-in model after the embedded default's supervised warm-up: 3-digit addition
    until held-out greedy accuracy passes 30% (~330 steps of 128; built in-process, ~1 min)."""
    from lockstep.engine.sampler import Sampler
    from lockstep.engine.trainer import Trainer
    from lockstep.engine.types import AdamParams, Datum, SampleRequest, SamplingParams
    from lockstep.envs.arithmetic import ArithmeticTask, is_correct

    trainer = Trainer.from_pretrained(builtin_dir)
    tok, sampler, task = trainer.tokenizer, Sampler(trainer.model, trainer.tokenizer), ArithmeticTask(num_heldout=200)
    adam = AdamParams(learning_rate=3e-3, beta2=0.99, eps=1e-8, grad_clip_norm=1.0)
    for step in range(600):
        data = []
        for p in task.problems(step, 128, stream="sft"):
            prompt, answer = tok.encode(p.prompt), tok.encode(p.answer) + [tok.eos_token_id]
            data.append(Datum.from_tokens(prompt + answer, weights=[0.0] * (len(prompt) - 1) + [1.0] * len(answer)))
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(adam)
        if (step + 1) % 5 == 0:
            greedy = SamplingParams(max_tokens=6, temperature=0.0)
            res = sampler.sample([SampleRequest(tuple(tok.encode(p.prompt)), greedy) for p in task.heldout])
            if sum(is_correct(p, r.sequences[0].tokens, tok) for p, r in zip(task.heldout, res)) >= 0.3 * 200:
                break
    return str(trainer.save_weights_for_sampler(tmp_path_factory.mktemp("warm") / "model", kind="merged"))


def random_arch_dir(tmp_path_factory, arch: str) -> str:
    """A small random model of `arch`, built from a config in code and saved with save_pretrained
    (no download). Every weight, norms included, is redrawn far from its init (norms at 1, tiny
    projections), so that a missing or wrong piece of the forward (Qwen3's q/k norms, an explicit
    head_dim, biases) moves the logprobs by much more than float32 rounding."""
    import json

    from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config,
                              Qwen3MoeConfig)

    from lockstep.engine.tiny import build_char_tokenizer, char_vocab

    common = dict(vocab_size=len(char_vocab()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu", eos_token_id=2, pad_token_id=0)
    config = {
        "qwen2": lambda: Qwen2Config(**common),
        "llama": lambda: LlamaConfig(**common, attention_bias=False),
        "qwen3": lambda: Qwen3Config(**common, head_dim=24, use_sliding_window=False),  # head_dim != 64 / 4
        "mistral": lambda: MistralConfig(**common, sliding_window=None),
        # Mixtures of experts: 4 experts, 2 per token; Qwen3-MoE with a dense first layer
        "qwen3_moe": lambda: Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                            num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                                            use_sliding_window=False),
        "mixtral": lambda: MixtralConfig(**{**common, "intermediate_size": 48}, num_local_experts=4,
                                         num_experts_per_tok=2, sliding_window=None),
    }[arch]()
    torch.manual_seed(len(arch))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = 3.0 if "lm_head" in name else 1.0  # logits spread over several nats
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else gain * torch.randn_like(p) / p.shape[-1] ** 0.5)
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path, safe_serialization=True)
    build_char_tokenizer().save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == arch
    return str(path)


ARCHITECTURES = ("qwen2", "llama", "qwen3", "mistral", "qwen3_moe", "mixtral")


@pytest.fixture(scope="session")
def arch_dirs(tmp_path_factory):
    """A random model directory of every supported architecture (random_arch_dir)."""
    return {arch: random_arch_dir(tmp_path_factory, arch) for arch in ARCHITECTURES}
