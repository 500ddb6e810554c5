"""LoRA through peft, and weight export for samplers outside lockstep.

Export writes into a temporary directory and commits it atomically (see checkpoint_io), so a
reader never sees a half-written model directory.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

from lockstep.engine import checkpoint_io
from lockstep.engine.types import EngineError, LoraSpec


def attach(hf_model, spec: LoraSpec):
    """Wrap a transformers model with a fresh LoRA adapter (seeded; dropout 0 so that the
    trainer's forward is the sampler's)."""
    from peft import LoraConfig, get_peft_model

    if any(name.endswith(".experts") for name, _ in hf_model.named_modules()):
        # peft wraps a mixture's fused expert weights in a ParamWrapper whatever the targets say
        # (and then leaves the dense MLPs alone), which the invariant forward does not read.
        raise EngineError("LoRA on a mixture-of-experts model is not supported yet; train it fully (lora_rank 0), "
                          "choosing which experts train with model.train_experts")
    present = {name.rsplit(".", 1)[-1] for name, _ in hf_model.named_modules()}
    missing = [m for m in spec.target_modules if m not in present]
    if missing:
        raise EngineError(f"lora target_modules {missing} are not modules of this model; it has e.g. "
                          f"{sorted(m for m in present if m.endswith('proj'))}")
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        return get_peft_model(hf_model, config)


def _write_dir(path: Path, overwrite: bool, fill, meta: dict) -> Path:
    """Let `fill(tmp_dir)` write files, then commit the directory atomically at `path`."""
    tmp = checkpoint_io.staging_directory(path)
    try:
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return checkpoint_io.commit_directory(tmp, path, meta=meta, overwrite=overwrite)


def export(trainer, path, *, kind: str = "merged", overwrite: bool = False) -> Path:
    """kind="merged": an HF directory AutoModelForCausalLM loads (LoRA folded into the weights);
    kind="adapter": a PEFT adapter directory (LoRA only)."""
    model = trainer.hf_model
    is_lora = hasattr(model, "peft_config")
    if kind not in ("merged", "adapter"):
        raise EngineError(f"export kind must be 'merged' or 'adapter', got {kind!r}")
    if kind == "adapter" and not is_lora:
        raise EngineError("kind='adapter' needs a LoRA model; this one is fully fine-tuned, use kind='merged'")

    def fill(tmp: Path) -> None:
        if kind == "adapter":
            model.save_pretrained(tmp, safe_serialization=True)
        else:
            plain = copy.deepcopy(model).merge_and_unload() if is_lora else model
            plain.save_pretrained(tmp, safe_serialization=True)
        trainer.tokenizer.save_pretrained(tmp)

    meta = {"format": "lockstep-export", "kind": kind, "base_model": trainer.base_model, "step": trainer.step}
    return _write_dir(path, overwrite, fill, meta)
