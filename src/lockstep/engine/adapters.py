"""One frozen base per worker, and the LoRA clients bound to it.

A `SharedBase` holds one copy of a base model (frozen: no gradient, never stepped) and its
InvariantLM; every LoRA training client and every sampler of that base shares it. A client's own
state is an `AdapterTrainer`: its adapter (A and B per target projection, `AdapterWeights` over
nn.Parameters), their gradients, the AdamW moments and the step; megabytes, not the base's copy.
Nothing wraps the shared base in peft: the forward reads each call's adapters per row
(engine/multi_lora.py), so one base serves any number of adapters, mixed in one batch
(engine/packed.py for training, the sampler's `SampleRequest.adapter` for sampling).

Compatibility with a `Trainer(lora=...)` (a peft-wrapped private copy): the same LoraSpec gives the
same initial weights (peft's initialisation, redone here in its order); parameters carry peft's
names, so the two load each other's `save_state` directories; and from the same weights the two
compute the same logprobs and gradients, bit for bit. Exports are PEFT adapter directories and
merged HF directories, as the Trainer writes them (engine/lora.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import torch

from lockstep.engine import lora as lora_mod
from lockstep.engine import packed
from lockstep.engine import state as state_mod
from lockstep.engine.device import CPU, Compute
from lockstep.engine.loading import load_model
from lockstep.engine.model import InvariantLM
from lockstep.engine.multi_lora import ADAPTABLE, HEAD, HEAD_LAYER, TARGETS
from lockstep.engine.trainer import TrainState, adamw_step
from lockstep.engine.types import (AdamParams, AdapterWeights, Datum, EngineError, ForwardBackwardOutput, LoraFactors,
                                   LoraSpec, TrainGroup)


class SharedBase:
    """One frozen base model (on one device, in one dtype) that adapters and samplers share."""

    def __init__(self, hf_model, tokenizer, *, base_model: str, compute: Compute = CPU):
        compute.check()
        if hasattr(hf_model, "peft_config"):
            raise EngineError("a shared base must be a plain transformers model; this one is wrapped by peft")
        hf_model.requires_grad_(False)  # frozen: nothing computes or keeps a gradient of the base
        self.hf_model = hf_model.to(compute.device).eval()
        self.model = InvariantLM(self.hf_model, compute)
        self.tokenizer = tokenizer
        self.base_model = str(base_model)
        self.compute = compute
        self.vocab_size = self.model.config.vocab_size
        self.shapes = self.model.projection_shapes()
        """(layer, target) -> (in, out) of every projection an adapter may target."""
        names = {id(m): n for n, m in self.hf_model.named_modules()}
        self._module_names = {(i, t): names[id(getattr(m, "base_layer", m))] for i, lp in enumerate(self.model._plan)
                              if lp.moe is None for t, m in zip(TARGETS, lp.projections)}
        self._module_names[(HEAD_LAYER, HEAD)] = names[id(self.model.lm_head)]  # "lm_head", tied or not
        self._is_moe = any(lp.moe is not None for lp in self.model._plan)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, compute: Compute = CPU) -> "SharedBase":
        compute.check()
        hf_model, tokenizer = load_model(model_dir)
        return cls(hf_model, tokenizer, base_model=str(model_dir), compute=compute)

    def module_name(self, layer: int, target: str) -> str:
        """The projection's name in the base model ("model.layers.0.self_attn.q_proj")."""
        return self._module_names[(layer, target)]

    def check_spec(self, spec: LoraSpec) -> None:
        """EngineError naming the limit when this base cannot take an adapter of this shape."""
        if not isinstance(spec, LoraSpec):
            raise EngineError(f"lora must be a LoraSpec, got {type(spec).__name__}")
        if self._is_moe:
            raise EngineError("LoRA on a mixture-of-experts model is not supported yet; train it fully (lora_rank 0)")
        unknown = [t for t in spec.target_modules if t not in ADAPTABLE]
        if unknown:
            raise EngineError(f"lora target_modules {unknown} cannot be adapted on a shared base; choose from "
                              f"{list(ADAPTABLE)}")
        limit = min(min(self.shapes[(i, t)]) for (i, t) in self.shapes if t in spec.target_modules)
        if spec.rank > limit:
            raise EngineError(f"lora rank {spec.rank} exceeds this base's limit for target_modules "
                              f"{list(spec.target_modules)}: at most {limit} (the smallest input or output size "
                              f"of a targeted projection)")

    def new_adapter(self, spec: LoraSpec, *, name: str = "adapter") -> AdapterWeights:
        """A fresh trainable adapter: peft's initialisation under `spec.seed` (A Kaiming-uniform, B
        zero, drawn in the base's module order on the CPU), so the same spec gives a Trainer's
        peft adapter bit for bit."""
        self.check_spec(spec)
        keys = [k for k, n in sorted(self._module_names.items(), key=lambda kv: self._order[kv[1]])
                if k[1] in spec.target_modules]
        factors = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            for key in keys:
                fan_in, fan_out = self.shapes[key]
                a = torch.nn.Linear(fan_in, spec.rank, bias=False)  # draws as peft's layer does, then re-inits A
                b = torch.nn.Linear(spec.rank, fan_out, bias=False)
                torch.nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
                torch.nn.init.zeros_(b.weight)
                factors[key] = LoraFactors(torch.nn.Parameter(a.weight.detach().to(self.compute.device)),
                                           torch.nn.Parameter(b.weight.detach().to(self.compute.device)),
                                           spec.alpha / spec.rank)
        return AdapterWeights(name, 0, spec, factors)

    @property
    def _order(self) -> dict[str, int]:
        return {n: i for i, (n, _) in enumerate(self.hf_model.named_modules())}

    def param_names(self, adapter: AdapterWeights) -> dict[str, torch.Tensor]:
        """The adapter's tensors under peft's parameter names, sorted (a Trainer's `params`)."""
        out = {}
        for (layer, target), f in adapter.factors.items():
            stem = f"base_model.model.{self.module_name(layer, target)}"
            out[f"{stem}.lora_A.default.weight"] = f.a
            out[f"{stem}.lora_B.default.weight"] = f.b
        return dict(sorted(out.items()))


def snapshot(adapter: AdapterWeights, version: int) -> AdapterWeights:
    """An immutable copy of an adapter's weights now (detached clones): what a sampler row names."""
    factors = {k: LoraFactors(f.a.detach().clone(), f.b.detach().clone(), f.scaling) for k, f in adapter.factors.items()}
    return AdapterWeights(adapter.name, int(version), adapter.spec, factors)


class AdapterTrainer(TrainState):
    """A LoRA client on a shared base: its adapter, the adapter's gradients, AdamW moments and
    step; Tinker's semantics (gradients accumulate over forward_backward calls until optim_step).
    Its forward and forward_backward are packed ones with a single model (engine/packed.py), so a
    call alone and the same call packed with other models give the same bits."""

    def __init__(self, base: SharedBase, lora: LoraSpec, *, name: str = "adapter"):
        self.base = base
        self.lora = lora
        self.name = name
        self.adapter = base.new_adapter(lora, name=name)
        self.params = base.param_names(self.adapter)
        self.frozen_experts: list = []  # (the optimizer step is the Trainer's: no experts here)
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=1e-4, foreach=False)
        self.step = 0
        self.data_position: dict | int | None = None
        self.share_prefixes = True
        """Run a shared prompt's forward once per group of this model's datums (same bits, fewer rows)."""

    @classmethod
    def from_state(cls, base: SharedBase, path: str | Path, *, optimizer: bool = True,
                   name: str = "adapter") -> "AdapterTrainer":
        """The client a state directory came from (a Trainer's with LoRA too), on this base."""
        meta = state_mod.read_meta(path)
        if not meta.get("lora"):
            raise EngineError(f"{path}: a full fine-tuning state, not a LoRA adapter's")
        trainer = cls(base, LoraSpec(**{**meta["lora"], "target_modules": tuple(meta["lora"]["target_modules"])}),
                      name=name)
        trainer.load_state(path, optimizer=optimizer)
        return trainer

    @property
    def base_model(self) -> str:
        return self.base.base_model

    @property
    def tokenizer(self):
        return self.base.tokenizer

    @property
    def model(self) -> InvariantLM:
        return self.base.model

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    # -- compute -----------------------------------------------------------------------------
    def forward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy", loss_fn_config=None) -> ForwardBackwardOutput:
        return _one(packed.packed_forward(self.base, [TrainGroup(self, tuple(data), loss_fn, loss_fn_config)]))

    def forward_backward(self, data: Sequence[Datum], loss_fn: str, loss_fn_config=None) -> ForwardBackwardOutput:
        return _one(packed.packed_forward_backward(self.base, [TrainGroup(self, tuple(data), loss_fn, loss_fn_config)]))

    def optim_step(self, adam: AdamParams = AdamParams()) -> dict[str, float]:
        """One AdamW step of this adapter's parameters only (the base never moves)."""
        return adamw_step(self, adam)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def snapshot(self) -> AdapterWeights:
        """The adapter's weights now, immutable, versioned by the step: for a sampler's rows."""
        return snapshot(self.adapter, self.step)

    # -- state (save_state, load_state, weights_numpy: TrainState, the LoRA Trainer's format) --
    def save_weights_for_sampler(self, path: str | Path, *, kind: str = "merged", overwrite: bool = False) -> Path:
        """A merged HF directory (kind="merged") or a PEFT adapter directory (kind="adapter")."""
        return lora_mod.export_shared(self, path, kind=kind, overwrite=overwrite)


def _one(results: list) -> ForwardBackwardOutput:
    (result,) = results
    if isinstance(result, Exception):
        raise result
    return result
