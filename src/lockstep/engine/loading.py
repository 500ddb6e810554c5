"""Load a local Hugging Face causal-LM directory through transformers.

Only architectures whose forward `engine.model` can run batch-invariantly are accepted; anything
else is refused with a message listing what is supported, rather than silently running a forward
whose sampler and trainer logprobs would disagree.
"""

from __future__ import annotations

import json
from pathlib import Path

from lockstep.engine.types import EngineError

# model_type -> notes. All are the Llama family: RMSNorm, RoPE, GQA attention, SiLU-gated MLP.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM (per-head q/k RMSNorm)",
    "mistral": "MistralForCausalLM (without sliding window)",
    "qwen3_moe": "Qwen3MoeForCausalLM (mixture of experts, per-head q/k RMSNorm)",
    "mixtral": "MixtralForCausalLM (mixture of experts, without sliding window)",
}


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir)
    cfg = path / "config.json"
    if not path.is_dir():
        raise EngineError(f"model directory {str(path)!r} does not exist")
    if not cfg.is_file():
        raise EngineError(f"{str(path)!r} has no config.json; expected a Hugging Face model directory")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise EngineError(f"{cfg} is not valid JSON: {e}") from None


def check_supported(config: dict) -> None:
    """Raise EngineError naming the problem if the invariant forward cannot run this config."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
        raise EngineError(
            f"unsupported architecture model_type={model_type!r} "
            f"(architectures={config.get('architectures')}); lockstep's batch-invariant forward "
            f"supports: {supported}"
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise EngineError(f"hidden_act={act!r} is not supported; the invariant MLP implements silu")
    if config.get("pretraining_tp", 1) not in (1, None):
        raise EngineError("pretraining_tp > 1 is not supported; re-save the model with pretraining_tp=1")
    rope = config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) == "dynamic":
        raise EngineError("dynamic RoPE scaling changes with length and cannot be batch-invariant")
    if config.get("use_sliding_window") or (model_type in ("mistral", "mixtral") and config.get("sliding_window")):
        raise EngineError("sliding-window attention is not supported; set sliding_window to null")


def load_model(model_dir: str | Path, *, dtype=None):
    """Return (hf_model, tokenizer) for a supported local HF directory, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = read_config(model_dir)
    check_supported(config)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype or torch.float32, attn_implementation="eager"
        )
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise EngineError(f"could not load model from {str(model_dir)!r}: {e}") from None
    model.eval()
    return model, tokenizer
