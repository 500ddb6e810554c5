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


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("use_lora", [False, True])
def test_forward_is_bitwise_invariant(arch, use_lora, qwen2_dir, llama_dir):
    hf, _ = load_model(qwen2_dir if arch == "qwen2" else llama_dir)
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


def test_forward_matches_transformers_closely(qwen2_dir):
    hf, _ = load_model(qwen2_dir)
    model = InvariantLM(hf)
    seq = list(range(10, 60))
    ours = _full_logprobs(model, [seq])[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1)
    assert (ours - ref).abs().max() < 1e-4
