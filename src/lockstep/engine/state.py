"""save_state / load_state for a Trainer: weights, AdamW moments, RNG, step and data position.

Layout of a state directory (all tensors in safetensors, never pickle):
  model.safetensors      trainable parameters by name (LoRA adapters only, or every weight)
  optimizer.safetensors  "<param>.exp_avg", "<param>.exp_avg_sq", "<param>.step"
  rng.safetensors        torch / numpy / random generator states
  meta.json              step, data position, base model, LoRA shape, optimizer hyperparameters
  MANIFEST.json          sha256 of every file, written last (see checkpoint_io)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from lockstep.engine import checkpoint_io
from lockstep.engine.checkpoint_io import CheckpointError

FORMAT = "lockstep-trainer-state"


def read_meta(path) -> dict:
    _, meta = checkpoint_io.read_checkpoint(path, stems=())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a lockstep trainer state (format={meta.get('format')!r})")
    return meta


def _optimizer_tensors(trainer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in trainer.params.items():
        for key, value in trainer.optimizer.state.get(p, {}).items():
            out[f"{name}.{key}"] = value.detach().cpu() if torch.is_tensor(value) else torch.tensor(value)
    return out


def _hyperparams(trainer) -> dict:
    g = trainer.optimizer.param_groups[0]
    return {"lr": g["lr"], "betas": list(g["betas"]), "eps": g["eps"], "weight_decay": g["weight_decay"]}


def save_state(trainer, path, *, overwrite: bool = False) -> Path:
    meta = {
        "format": FORMAT,
        "step": trainer.step,
        "data_position": trainer.data_position,
        "base_model": trainer.base_model,
        "lora": dataclasses.asdict(trainer.lora) if trainer.lora else None,
        "param_names": list(trainer.params),
        "optimizer": {"type": "adamw", **_hyperparams(trainer)},
    }
    tensors = {
        "model": {n: p.detach().cpu() for n, p in trainer.params.items()},
        "optimizer": _optimizer_tensors(trainer),
        "rng": checkpoint_io.rng_state_tensors(),
    }
    return checkpoint_io.write_checkpoint(path, tensors=tensors, meta=meta, overwrite=overwrite)


def _check_compatible(trainer, meta: dict, weights: dict, path) -> None:
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a lockstep trainer state (format={meta.get('format')!r})")
    want, have = set(trainer.params), set(weights)
    if want != have:
        raise CheckpointError(
            f"{path}: parameters do not match this model (missing {sorted(want - have)[:3]}, "
            f"unexpected {sorted(have - want)[:3]}); was it saved with another base model or LoRA shape?"
        )
    for name, p in trainer.params.items():
        if weights[name].shape != p.shape:
            raise CheckpointError(f"{path}: {name} has shape {tuple(weights[name].shape)}, model has {tuple(p.shape)}")


def load_state(trainer, path, *, optimizer: bool = True) -> dict:
    tensors, meta = checkpoint_io.read_checkpoint(path)  # verifies every hash first
    weights = tensors.get("model", {})
    _check_compatible(trainer, meta, weights, path)
    with torch.no_grad():
        for name, p in trainer.params.items():
            p.copy_(weights[name])
    trainer.optimizer.state.clear()
    if optimizer:
        opt = tensors.get("optimizer", {})
        for name, p in trainer.params.items():
            # moments go to the parameter's device; the step count stays a CPU scalar, as AdamW keeps it
            state = {k.rsplit(".", 1)[1]: v.clone() if v.dim() == 0 else v.to(p.device, copy=True)
                     for k, v in opt.items() if k.rsplit(".", 1)[0] == name}
            if state:
                trainer.optimizer.state[p] = state
        hp = meta["optimizer"]
        for group in trainer.optimizer.param_groups:
            group.update(lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"], weight_decay=hp["weight_decay"])
    trainer.zero_grad()
    trainer.step = int(meta["step"])
    trainer.data_position = meta.get("data_position")
    if "rng" in tensors:
        checkpoint_io.restore_rng_state(tensors["rng"])
    return meta
