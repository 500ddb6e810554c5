"""Trainer primitives with Tinker semantics: forward, forward_backward, optim_step, state I/O.

Gradients accumulate across forward_backward calls until optim_step, as in Tinker. Every loss is
summed over tokens. The forward is `InvariantLM`'s, the same one the sampler runs, so the
logprobs returned here equal the sampler's bit for bit.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from lockstep.engine import lora as lora_mod
from lockstep.engine import state as state_mod
from lockstep.engine.batching import Batch, make_batch
from lockstep.engine.device import CPU, Compute
from lockstep.engine.loading import load_model
from lockstep.engine.model import InvariantLM
from lockstep.engine.prefix import plan_prefixes, shared_prefix_logsoftmax
from lockstep.engine.types import AdamParams, Datum, EngineError, ForwardBackwardOutput, LoraSpec
from lockstep.losses import LossInputs, compute_loss, missing_input


class TrainState:
    """Checkpointing shared by the trainers (Trainer, engine/adapters.py's AdapterTrainer): both keep
    `params`, an optimizer, `step` and `data_position` in engine/state.py's format."""

    def save_state(self, path: str | Path, *, data_position=None, overwrite: bool = False) -> Path:
        """Weights, optimizer, RNG, step and data position, written atomically (safetensors only)."""
        if data_position is not None:
            self.data_position = data_position
        return state_mod.save_state(self, path, overwrite=overwrite)

    def load_state(self, path: str | Path, *, optimizer: bool = True) -> dict:
        """Load a checkpoint written by save_state; verifies the manifest before touching anything."""
        return state_mod.load_state(self, path, optimizer=optimizer)

    def weights_numpy(self) -> dict[str, np.ndarray]:
        """A copy of the trainable weights as NumPy arrays (for publishing and tests)."""
        return {n: p.detach().cpu().numpy().copy() for n, p in self.params.items()}


class Trainer(TrainState):
    """Owns a model's trainable parameters, its AdamW state, and the step counter."""

    def __init__(self, hf_model, tokenizer, *, base_model: str, lora: LoraSpec | None = None,
                 train_experts: Sequence[int] | None = None, compute: Compute = CPU):
        self.base_model = str(base_model)
        self.lora = lora
        self.tokenizer = tokenizer
        compute.check()  # before moving anything: no GPU or no Triton is an error, never a CPU fallback
        # LoRA is initialised on the CPU (its seeded init the same on every device), then moved;
        # parameters stay float32 on any device (the optimizer's master weights, see InvariantLM).
        self.hf_model = (lora_mod.attach(hf_model, lora) if lora is not None else hf_model).to(compute.device)
        self.model = InvariantLM(self.hf_model, compute)
        self.vocab_size = self.model.config.vocab_size
        self.params = dict(sorted((n, p) for n, p in self.hf_model.named_parameters() if p.requires_grad))
        self.frozen_experts = _frozen_expert_rows(self.hf_model, train_experts)
        """(parameter, indices of its frozen experts) for each expert weight, if experts are chosen."""
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=1e-4, foreach=False)
        self.step = 0
        self.data_position: dict | int | None = None
        self.share_prefixes = True
        """Run a shared prompt's forward once per group (same logprobs, fewer rows)."""

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, lora: LoraSpec | None = None,
                        train_experts: Sequence[int] | None = None, compute: Compute = CPU) -> "Trainer":
        compute.check()
        hf_model, tokenizer = load_model(model_dir)
        return cls(hf_model, tokenizer, base_model=str(model_dir), lora=lora, train_experts=train_experts,
                   compute=compute)

    @classmethod
    def from_state(cls, path: str | Path, *, optimizer: bool = True, compute: Compute = CPU) -> "Trainer":
        """Rebuild the trainer a checkpoint came from (base model + LoRA shape), then load it."""
        meta = state_mod.read_meta(path)
        lora = LoraSpec(**meta["lora"]) if meta.get("lora") else None
        trainer = cls.from_pretrained(meta["base_model"], lora=lora, compute=compute)
        trainer.load_state(path, optimizer=optimizer)
        return trainer

    # -- forward -----------------------------------------------------------------------------
    def _logprobs(self, data: Sequence[Datum], batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Learner log p(target) at every valid position, flattened over datums, and the mean
        entropy of the learner's distribution where the loss applies (weights > 0).

        Datums that share a prompt (a GRPO group) share its forward (engine/prefix.py): the same
        bits, fewer rows."""
        inputs = [tuple(d.model_input) for d in data]
        plan = plan_prefixes(inputs) if self.share_prefixes else None
        self.model.reset_router_counts()
        if plan is None:
            lp_BT, entropy_BT = self.model.logprobs_and_entropy(self.model.hidden_states(batch.tokens_BT), batch.targets_BT)
            lp_T, entropy_T = lp_BT[batch.valid_BT], entropy_BT[batch.valid_BT]
        else:
            lsm_TV = shared_prefix_logsoftmax(self.model, inputs, plan)
            lp_T = lsm_TV.gather(-1, batch.targets_BT[batch.valid_BT].unsqueeze(-1)).squeeze(-1)
            with torch.no_grad():
                entropy_T = -(lsm_TV.exp() * lsm_TV).sum(-1)
        if "weights" in batch.floats:
            entropy_T = entropy_T[batch.floats["weights"] > 0]
        metrics = {"entropy:mean": float(entropy_T.mean())} if entropy_T.numel() else {}
        metrics.update(self.model.router_metrics())
        return lp_T, metrics

    def _batch(self, data: Sequence[Datum], loss_fn: str, config) -> Batch:
        return checked_batch(data, self.vocab_size, loss_fn, config)

    def _loss(self, batch: Batch, lp_T: torch.Tensor, loss_fn: str, config: Mapping[str, float]):
        return loss_of(batch, lp_T, loss_fn, config)

    def _outputs(self, batch: Batch, lp_T, elementwise_T, metrics, loss) -> ForwardBackwardOutput:
        return outputs_of(batch, lp_T, elementwise_T, metrics, loss)

    def forward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy", loss_fn_config=None) -> ForwardBackwardOutput:
        """Logprobs and loss without touching gradients."""
        with torch.no_grad(), self.model.compute.scope():
            batch = self._batch(data, loss_fn, loss_fn_config)
            lp_T, entropy = self._logprobs(data, batch)
            elementwise, metrics = self._loss(batch, lp_T, loss_fn, loss_fn_config)
        return self._outputs(batch, lp_T, elementwise, {**metrics, **entropy}, elementwise.sum())

    def forward_backward(self, data: Sequence[Datum], loss_fn: str, loss_fn_config=None) -> ForwardBackwardOutput:
        """Accumulate gradients of sum(elementwise loss); returns per-datum logprobs and metrics."""
        with torch.enable_grad(), self.model.compute.scope():
            batch = self._batch(data, loss_fn, loss_fn_config)
            lp_T, entropy = self._logprobs(data, batch)
            elementwise, metrics = self._loss(batch, lp_T, loss_fn, loss_fn_config)
            metrics = {**metrics, **entropy}
            loss = elementwise.sum()
            if not torch.isfinite(loss):
                raise EngineError(f"loss is {float(loss)}; gradients were not applied")
            loss.backward()
        return self._outputs(batch, lp_T, elementwise, metrics, loss.detach())

    # -- optimizer ---------------------------------------------------------------------------
    def optim_step(self, adam: AdamParams = AdamParams()) -> dict[str, float]:
        """One AdamW step with these hyperparameters on the accumulated gradients, then zero them."""
        return adamw_step(self, adam)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # -- state (save_state, load_state, weights_numpy: TrainState) ----------------------------
    def save_weights_for_sampler(self, path: str | Path, *, kind: str = "merged", overwrite: bool = False) -> Path:
        """Export an HF directory (kind="merged") or a PEFT adapter (kind="adapter", LoRA only)."""
        return lora_mod.export(self, path, kind=kind, overwrite=overwrite)


def checked_batch(data: Sequence[Datum], vocab_size: int, loss_fn: str, config) -> Batch:
    """The checked batch; a datum without an input the loss needs is refused here, before any
    compute (below, a missing logprobs or advantages would be trained on as zeros)."""
    batch = make_batch(data, vocab_size)
    problem = missing_input(loss_fn, config, (d.loss_fn_inputs.keys() for d in data))
    if problem is not None:
        raise EngineError(problem)
    return batch


def loss_of(batch: Batch, lp_T: torch.Tensor, loss_fn: str, config: Mapping[str, float] | None):
    """(elementwise loss (T,), metrics) of one model's datums: the loss and its normalisation see
    that batch's datums only."""
    f = batch.floats
    segment = torch.repeat_interleave(torch.arange(len(batch.lengths)), torch.tensor(batch.lengths))
    zeros, ones = torch.zeros_like(lp_T), torch.ones_like(lp_T)
    inputs = LossInputs(
        logprobs_T=lp_T,
        sampler_logprobs_T=f.get("logprobs", zeros),
        advantages_T=f.get("advantages", zeros),
        weights_T=f.get("weights", ones),
        mask_T=f.get("sequence_ratio_mask", ones),
        segment_T=segment,
        num_segments=len(batch.lengths),
        clip_low_T=f.get("clip_low_threshold"),
        clip_high_T=f.get("clip_high_threshold"),
    )
    return compute_loss(loss_fn, inputs, dict(config or {}))


def outputs_of(batch: Batch, lp_T, elementwise_T, metrics, loss) -> ForwardBackwardOutput:
    outs, start = [], 0
    lp = lp_T.detach().cpu().numpy()
    el = elementwise_T.detach().cpu().numpy()
    for n in batch.lengths:
        outs.append({"logprobs": lp[start : start + n].copy(), "elementwise_loss": el[start : start + n].copy()})
        start += n
    merged = {"loss:sum": float(loss)}
    merged.update(metrics)
    return ForwardBackwardOutput(tuple(outs), merged)


def adamw_step(owner, adam: AdamParams) -> dict[str, float]:
    """One AdamW step of `owner` (a Trainer or an AdapterTrainer: its params, optimizer,
    frozen_experts and step) on the accumulated gradients, then zero them."""
    params = list(owner.params.values())
    for p, frozen in owner.frozen_experts:  # no gradient, so no norm, clipping or Adam moment
        if p.grad is not None:
            p.grad[frozen] = 0.0
    kept = [(p, p.detach()[frozen].clone()) for p, frozen in owner.frozen_experts]  # weight decay moves them
    grads = [p.grad for p in params if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
    if not math.isfinite(norm):
        owner.optimizer.zero_grad(set_to_none=True)
        raise EngineError("gradient norm is not finite; the step was skipped and gradients cleared")
    if adam.grad_clip_norm > 0 and grads:
        torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm, foreach=False)
    for group in owner.optimizer.param_groups:
        group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                     weight_decay=adam.weight_decay)
    owner.optimizer.step()
    with torch.no_grad():
        for (p, frozen), (_, rows) in zip(owner.frozen_experts, kept):
            p[frozen] = rows
    owner.optimizer.zero_grad(set_to_none=True)
    owner.step += 1
    return {"grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate, "step:max": float(owner.step)}


def _frozen_expert_rows(hf_model, train_experts: Sequence[int] | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For `train_experts`, each expert weight (E, ...) with the indices of the experts that do not
    train; [] when every expert trains."""
    if train_experts is None:
        return []
    blocks = [m for name, m in hf_model.named_modules() if name.endswith(".experts")]
    if not blocks:
        raise EngineError("model.train_experts needs a mixture-of-experts model (Qwen3-MoE, Mixtral); this one has "
                          "no experts")
    num = blocks[0].gate_up_proj.shape[0]
    bad = [e for e in train_experts if not 0 <= e < num]
    if bad:
        raise EngineError(f"model.train_experts {bad} out of range: the model has {num} experts per layer (0..{num - 1})")
    frozen = torch.tensor([e for e in range(num) if e not in set(train_experts)], dtype=torch.long)
    if not frozen.numel():
        return []
    return [(p, frozen.to(p.device)) for b in blocks for p in (b.gate_up_proj, b.down_proj) if p.requires_grad]
