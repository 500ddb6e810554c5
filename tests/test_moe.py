"""Mixture-of-experts training: chosen experts train, the others stay bitwise unchanged; the
router's load balance reaches the metrics; what is not supported is refused clearly."""

import numpy as np
import pytest
import torch

from lockstep.config import load
from lockstep.config.types import ConfigError
from lockstep.engine.model import RoutingLog
from lockstep.engine.trainer import Trainer
from lockstep.engine.types import AdamParams, Datum, EngineError, LoraSpec


def batch(step: int):
    rng = np.random.default_rng(step)
    return [Datum.from_tokens(rng.integers(4, 250, 12 + 3 * i).tolist()) for i in range(6)]


def expert_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.hf_model.named_parameters() if ".experts." in n}


def test_only_the_chosen_experts_train_and_the_others_stay_bitwise_unchanged(moe_dir):
    trainer = Trainer.from_pretrained(moe_dir, train_experts=[0, 3])
    before = expert_weights(trainer)
    router_before = {n: p.detach().clone() for n, p in trainer.hf_model.named_parameters() if "mlp.gate." in n}
    assert before and router_before
    for step in range(4):  # weight decay would move every weight it touches
        trainer.forward_backward(batch(step), "cross_entropy")
        trainer.optim_step(AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0))
    after = expert_weights(trainer)
    for name, w in before.items():
        assert torch.equal(after[name][[1, 2]], w[[1, 2]]), name  # frozen experts: not one bit moved
        assert not torch.equal(after[name][[0, 3]], w[[0, 3]]), name  # chosen experts trained
    assert all(not torch.equal(p.detach(), router_before[n])
               for n, p in trainer.hf_model.named_parameters() if n in router_before)  # the router trains too


def test_every_expert_trains_by_default_and_the_router_load_is_in_the_metrics(moe_dir):
    trainer = Trainer.from_pretrained(moe_dir)
    before = expert_weights(trainer)
    trainer.model.routing = RoutingLog()  # what the router chose, to check the metrics against
    out = trainer.forward_backward(batch(0), "cross_entropy")
    trainer.optim_step(AdamParams(learning_rate=1e-2))
    after = expert_weights(trainer)
    assert all(not torch.equal(after[n][e], w[e]) for n, w in before.items() for e in range(4))
    # layer 0 is dense (mlp_only_layers); layers 1 and 2 route
    assert {k for k in out.metrics if k.startswith("router/")} == {
        f"router/l{i}_{m}:max" for i in (1, 2) for m in ("max_load", "experts_used")}
    for i in (1, 2):  # every forward call of the step (shared prefixes make two) counted
        counts = sum(torch.bincount(call[i].flatten(), minlength=4) for call in trainer.model.routing.calls)
        assert out.metrics[f"router/l{i}_max_load:max"] == counts.max().item() / (counts.sum().item() / 4)
        assert out.metrics[f"router/l{i}_experts_used:max"] == float((counts > 0).sum())


def test_what_mixtures_do_not_support_is_refused_with_what_to_do(moe_dir, qwen2_dir):
    with pytest.raises(EngineError, match=r"train_experts \[4\] out of range: the model has 4 experts"):
        Trainer.from_pretrained(moe_dir, train_experts=[1, 4])
    with pytest.raises(EngineError, match="needs a mixture-of-experts model"):
        Trainer.from_pretrained(qwen2_dir, train_experts=[0])
    with pytest.raises(EngineError, match="LoRA on a mixture-of-experts model is not supported yet"):
        Trainer.from_pretrained(moe_dir, lora=LoraSpec(rank=4))
    with pytest.raises(ConfigError, match="model.train_experts: expected lora_rank 0"):
        load(None, ["model.train_experts=[0, 1]", "model.lora_rank=4"])
    with pytest.raises(ConfigError, match="model.train_experts: expected a list of distinct expert indices"):
        load(None, ["model.train_experts=[1, 1]"])
    assert load(None, ["model.train_experts=[3, 0]"]).model.train_experts == (0, 3)
