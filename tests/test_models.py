"""Model loading, the built-in tiny model, and the batch-invariant forward end to end."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lockstep.engine.loading import load_model
from lockstep.engine.model import InvariantLM
from lockstep.engine.tiny import TINY_NAME
from lockstep.engine.types import EngineError, LoraSpec
from lockstep.engine import lora as lora_mod


def test_builtin_model_is_a_small_qwen2_hf_directory(builtin_dir):
    config = json.loads(open(f"{builtin_dir}/config.json").read())
    assert config["model_type"] == "qwen2"
    model = AutoModelForCausalLM.from_pretrained(builtin_dir)
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n <= 5_000_000
    assert json.loads(open(f"{builtin_dir}/lockstep_tiny.json").read())["name"] == TINY_NAME


def test_char_tokenizer_round_trips_through_autotokenizer(builtin_dir):
    tok = AutoTokenizer.from_pretrained(builtin_dir)
    text = "12 + 345 = 357\nUser: héllo\t!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[:2] == [ord("1") + 4, ord("2") + 4]  # one token per byte
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(EngineError, match="unsupported architecture.*gpt2.*supports: llama"):
        load_model(tmp_path)


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        load_model(tmp_path / "nope")


def _full_logprobs(model, seqs):
    T = max(len(s) for s in seqs)
    toks = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = torch.tensor(s)
    with torch.no_grad():
        lp = torch.log_softmax(model.logits(model.hidden_states(toks)), -1)
    return [lp[i, : len(s)] for i, s in enumerate(seqs)]


def _decode_logprobs(model, seq, prefill):
    cache = model.new_cache(1, len(seq))
    with torch.no_grad():
        h = model.hidden_states(torch.tensor([seq[:prefill]]), torch.arange(prefill)[None], cache)
        outs = [torch.log_softmax(model.logits(h), -1)[0]]
        for t in range(prefill, len(seq)):
            h = model.hidden_states(torch.tensor([[seq[t]]]), torch.tensor([[t]]), cache)
            outs.append(torch.log_softmax(model.logits(h), -1)[0])
    return torch.cat(outs)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "mistral", "qwen3_moe", "mixtral"])
def test_forward_matches_transformers_own_forward(arch, arch_dirs):
    """Each supported architecture, loaded from its directory, computes what transformers does."""
    hf, _ = load_model(arch_dirs[arch])
    model = InvariantLM(hf)
    rng = random.Random(1)
    seqs = [[rng.randrange(4, 260) for _ in range(n)] for n in (50, 33, 7)]
    ours = _full_logprobs(model, seqs)
    for seq, lp in zip(seqs, ours):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1)
        assert ref.std(-1).min() > 2.0  # far from uniform: a wrong forward could not hide in rounding
        assert (lp - ref).abs().max() < 1e-4, arch


@pytest.mark.parametrize("arch, use_lora", [("qwen2", False), ("qwen2", True), ("llama", False), ("llama", True),
                                            ("qwen3", False), ("mistral", False), ("qwen3_moe", False),
                                            ("mixtral", False)])
def test_forward_is_bitwise_invariant(arch, use_lora, arch_dirs):
    hf, _ = load_model(arch_dirs[arch])
    if use_lora:
        hf = lora_mod.attach(hf, LoraSpec(rank=4, seed=3))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model = InvariantLM(hf)
    rng = random.Random(0)
    seqs = [[rng.randrange(4, 260) for _ in range(rng.randint(1, 70))] for _ in range(64)]
    alone = [_full_logprobs(model, [s])[0] for s in seqs[:8]]
    for bs in (1, 2, 7, 64):
        batch = _full_logprobs(model, seqs[:bs])
        assert all(torch.equal(a, b) for a, b in zip(alone, batch))
    # other sequences in the batch, and padding, do not matter
    shuffled = [seqs[3]] + seqs[40:50]
    assert torch.equal(_full_logprobs(model, shuffled)[0], alone[3])
    # KV-cache decoding equals the full forward, whatever the prefill split
    for i in (0, 3, 5):
        s = seqs[i]
        if len(s) > 1:
            for prefill in {1, max(1, len(s) // 2)}:
                assert torch.equal(_decode_logprobs(model, s, prefill), alone[i])
    if use_lora:  # LoRA on and off both invariant, and LoRA really changes the output
        with hf.disable_adapter():
            off = _full_logprobs(model, seqs[:1])[0]
        assert not torch.equal(off, alone[0])


def _lora_on(hf, targets, seed=0):
    hf = lora_mod.attach(hf, LoraSpec(rank=4, seed=3, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return hf


def _per_op_hidden(model, toks):
    """The per-op path that the trainer runs under autograd (no decoder stack there)."""
    with torch.enable_grad():
        return model.hidden_states(toks).detach()


@pytest.mark.parametrize("arch, targets", [("qwen2", None), ("qwen2", ("q_proj", "v_proj", "down_proj")),
                                           ("llama", ("k_proj", "o_proj", "up_proj")), ("qwen3", None),
                                           ("qwen3", ("q_proj", "gate_proj")), ("mistral", None)])
def test_the_one_call_decoder_stack_computes_the_per_op_paths_bits(arch, targets, arch_dirs):
    """Outside autograd a dense model runs all its layers in one C++ call (kernels/stack.cpp); its
    hidden states, full-sequence and KV-cache decode, equal the per-op path's bit for bit, with LoRA
    on some projections only (zero updates on the others), and after weights move."""
    hf, _ = load_model(arch_dirs[arch])
    if targets:
        hf = _lora_on(hf, list(targets))
    model = InvariantLM(hf)
    assert model.path == "fused"
    rng = random.Random(2)
    toks = torch.tensor([[rng.randrange(4, 260) for _ in range(37)] for _ in range(3)])

    def check():
        with torch.no_grad():
            stacked = model.hidden_states(toks)
        assert model._stack is not None
        assert torch.equal(stacked, _per_op_hidden(model, toks))
        cache = model.new_cache(3, 37)
        with torch.no_grad():
            model.hidden_states(toks[:, :20], torch.arange(20).expand(3, 20), cache)
            step = model.hidden_states(toks[:, 20:21], torch.full((3, 1), 20), cache)
        assert torch.equal(step[:, 0], stacked[:, 20])

    check()
    layer = model.inner.layers[-1]
    before = model._stack
    with torch.no_grad():
        layer.post_attention_layernorm.weight.mul_(1.5)  # in place: the version counter moves
    check()
    o = layer.self_attn.o_proj
    o = getattr(o, "base_layer", o)
    o.weight.data = o.weight.data * -1.0  # a `.data` swap, as the generator's hot-swap does
    check()
    if targets:
        lora_b = next(p for n, p in hf.named_parameters() if "lora_B" in n)
        lora_b.data = lora_b.data + 0.05
        check()
        with hf.disable_adapter():  # adapters off: the stack follows
            check()
    assert model._stack is not before


def test_a_mixture_of_experts_keeps_the_per_op_path(arch_dirs):
    model = InvariantLM(load_model(arch_dirs["qwen3_moe"])[0])
    with torch.no_grad():
        model.hidden_states(torch.tensor([[5, 6, 7]]))
    assert model.path == "fused" and model._stack is None
