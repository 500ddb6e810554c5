"""LoRA through peft, and save_weights_for_sampler exports that transformers / peft load back."""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from lockstep.engine.loading import load_model
from lockstep.engine.model import InvariantLM
from lockstep.engine.trainer import Trainer
from lockstep.engine.types import AdamParams, Datum, EngineError, LoraSpec

SEQ = list(range(8, 48))


def _train(trainer, steps=3):
    for _ in range(steps):
        trainer.forward_backward([Datum.from_tokens(SEQ)], "cross_entropy")
        trainer.optim_step(AdamParams(learning_rate=2e-2))
    return trainer


def _ours(trainer):
    with torch.no_grad():
        return trainer.model.logits(trainer.model.hidden_states(torch.tensor([SEQ])))[0]


def _hf(model):
    with torch.no_grad():
        return model(torch.tensor([SEQ])).logits[0]


def test_lora_trains_only_adapter_weights(qwen2_dir):
    t = Trainer.from_pretrained(qwen2_dir, lora=LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj")))
    assert t.params and all("lora_" in n for n in t.params)
    assert all(("q_proj" in n or "v_proj" in n) for n in t.params)
    base = {n: p.detach().clone() for n, p in t.hf_model.named_parameters() if "lora_" not in n}
    _train(t)
    assert all(torch.equal(p, base[n]) for n, p in t.hf_model.named_parameters() if "lora_" not in n)


def test_merged_export_loads_with_transformers(tmp_path, qwen2_dir):
    t = _train(Trainer.from_pretrained(qwen2_dir, lora=LoraSpec(rank=4, alpha=16)))
    path = t.save_weights_for_sampler(tmp_path / "merged", kind="merged")
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert not any("lora" in n for n, _ in loaded.named_parameters())
    torch.testing.assert_close(_hf(loaded), _ours(t), rtol=1e-4, atol=1e-4)
    assert AutoTokenizer.from_pretrained(path).decode([ord("7") + 4]) == "7"
    hf, _ = load_model(path)  # the same loading path lockstep uses for any model
    torch.testing.assert_close(_hf(hf), _ours(t), rtol=1e-4, atol=1e-4)
    assert (path / "MANIFEST.json").exists()


def test_adapter_export_loads_with_peft(tmp_path, qwen2_dir):
    t = _train(Trainer.from_pretrained(qwen2_dir, lora=LoraSpec(rank=4, alpha=16)))
    path = t.save_weights_for_sampler(tmp_path / "adapter", kind="adapter")
    assert (path / "adapter_config.json").exists() and (path / "adapter_model.safetensors").exists()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen2_dir), path)
    torch.testing.assert_close(_hf(model), _ours(t), rtol=1e-4, atol=1e-4)
    # the reloaded adapter also runs in lockstep's invariant forward, bit for bit
    again = InvariantLM(model)
    with torch.no_grad():
        assert torch.equal(again.logits(again.hidden_states(torch.tensor([SEQ])))[0], _ours(t))


def test_full_finetune_exports_merged_only(tmp_path, qwen2_dir):
    t = _train(Trainer.from_pretrained(qwen2_dir))
    path = t.save_weights_for_sampler(tmp_path / "full")
    torch.testing.assert_close(_hf(AutoModelForCausalLM.from_pretrained(path)), _ours(t), rtol=1e-4, atol=1e-4)
    with pytest.raises(EngineError, match="adapter"):
        t.save_weights_for_sampler(tmp_path / "a", kind="adapter")


def test_export_refuses_to_overwrite_unless_asked(tmp_path, qwen2_dir):
    t = Trainer.from_pretrained(qwen2_dir)
    t.save_weights_for_sampler(tmp_path / "m")
    with pytest.raises(ValueError, match="exists"):
        t.save_weights_for_sampler(tmp_path / "m")
    t.save_weights_for_sampler(tmp_path / "m", overwrite=True)


def test_unknown_lora_target_is_a_clear_error(qwen2_dir):
    with pytest.raises(EngineError, match="not modules of this model"):
        Trainer.from_pretrained(qwen2_dir, lora=LoraSpec(target_modules=("qkv",)))
