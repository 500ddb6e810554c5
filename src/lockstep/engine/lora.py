"""LoRA through peft, and weight export for samplers outside lockstep.

Export writes into a temporary directory and commits it atomically (see checkpoint_io), so a
reader never sees a half-written model directory. An adapter on a shared base
(engine/adapters.py) exports to the same two formats as a peft-wrapped Trainer: a PEFT adapter
directory (peft's file names, keys and config) and a merged HF directory (peft's merge).

An adapted lm_head over a base whose lm_head is tied to its embeddings is merged into the lm_head
only: the merged directory is untied (`tie_word_embeddings` false, both matrices written). peft's
own merge would add the delta in place into the one shared matrix, changing the embeddings too (its
warning says so), so that the merged model would not compute what the adapter does.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

from lockstep.engine import checkpoint_io
from lockstep.engine.types import EngineError, LoraSpec

HEAD_WEIGHT = "lm_head.weight"


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
        elif is_lora:
            twin = copy.deepcopy(model)
            _untie_adapted_head(twin.base_model.model)
            twin.merge_and_unload().save_pretrained(tmp, safe_serialization=True)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        trainer.tokenizer.save_pretrained(tmp)

    meta = {"format": "lockstep-export", "kind": kind, "base_model": trainer.base_model, "step": trainer.step}
    return _write_dir(path, overwrite, fill, meta)


def export_shared(trainer, path, *, kind: str = "merged", overwrite: bool = False) -> Path:
    """export() for an AdapterTrainer: its adapter in PEFT's format (kind="adapter"), or folded into a
    copy of the shared base's weights as peft's merge folds it (kind="merged"); the base itself is
    never modified."""
    if kind not in ("merged", "adapter"):
        raise EngineError(f"export kind must be 'merged' or 'adapter', got {kind!r}")
    base, spec = trainer.base, trainer.lora

    def fill(tmp: Path) -> None:
        if kind == "adapter":
            _write_peft_adapter(tmp, base, trainer.adapter, spec)
        else:
            state = _merged_state(base, trainer.adapter)
            base.hf_model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            if _tied(base.hf_model) and _head_adapted(base, trainer.adapter):
                _untie_config(tmp)
        trainer.tokenizer.save_pretrained(tmp)

    meta = {"format": "lockstep-export", "kind": kind, "base_model": trainer.base_model, "step": trainer.step}
    return _write_dir(path, overwrite, fill, meta)


def _write_peft_adapter(tmp: Path, base, adapter, spec: LoraSpec) -> None:
    """adapter_config.json and adapter_model.safetensors as PeftModel.save_pretrained writes them."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM",
                        base_model_name_or_path=base.hf_model.config.name_or_path or None)
    config.save_pretrained(str(tmp))
    tensors = {}
    for (layer, target), f in adapter.factors.items():
        stem = f"base_model.model.{base.module_name(layer, target)}"
        tensors[f"{stem}.lora_A.weight"] = f.a.detach().cpu().contiguous()
        tensors[f"{stem}.lora_B.weight"] = f.b.detach().cpu().contiguous()
        if f"{base.module_name(layer, target)}.weight" == HEAD_WEIGHT:  # peft's save_embedding_layers="auto":
            # a targeted lm_head's base matrix is written too
            tensors[f"{stem}.base_layer.weight"] = base.hf_model.get_output_embeddings().weight.detach().cpu().contiguous()
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})


def _merged_state(base, adapter) -> dict[str, torch.Tensor]:
    """The base's state dict with each targeted weight W replaced by W + (B @ A) * scaling, peft's
    merge (get_delta_weight, then W += delta) on a copy."""
    state = dict(base.hf_model.state_dict())
    with torch.no_grad():
        for (layer, target), f in adapter.factors.items():
            key = f"{base.module_name(layer, target)}.weight"
            state[key] = state[key] + (f.b.detach() @ f.a.detach()) * f.scaling
    moved: dict[int, torch.Tensor] = {}  # tied weights (embeddings and LM head) stay one tensor, unless adapted
    return {k: moved[id(v)] if id(v) in moved else moved.setdefault(id(v), v.detach().cpu()) for k, v in state.items()}


def _tied(hf_model) -> bool:
    return hf_model.get_output_embeddings().weight is hf_model.get_input_embeddings().weight


def _head_adapted(base, adapter) -> bool:
    return any(f"{base.module_name(*key)}.weight" == HEAD_WEIGHT for key in adapter.factors)


def _untie_adapted_head(causal) -> None:
    """In a (copied) peft model whose lm_head LoRA wraps the embeddings' matrix: give the lm_head
    its own copy, so that the merge changes it alone, and say so in the config."""
    head = causal.get_output_embeddings()
    if hasattr(head, "base_layer") and head.base_layer.weight is causal.get_input_embeddings().weight:
        head.base_layer.weight = torch.nn.Parameter(head.base_layer.weight.detach().clone(), requires_grad=False)
        causal.config.tie_word_embeddings = False


def _untie_config(directory: Path) -> None:
    """The saved config of a merge whose lm_head now differs from the embeddings: untied (a loader
    would otherwise tie them again and drop the adapted lm_head)."""
    import json

    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    config["tie_word_embeddings"] = False
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
