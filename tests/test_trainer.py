"""Trainer primitives: Tinker semantics for forward, forward_backward and optim_step."""

import numpy as np
import pytest
import torch

from lockstep.engine.trainer import Trainer
from lockstep.engine.types import AdamParams, Datum


@pytest.fixture()
def trainer(qwen2_dir):
    return Trainer.from_pretrained(qwen2_dir)


def sft_data(n=4, length=20, seed=0):
    rng = np.random.default_rng(seed)
    return [Datum.from_tokens(rng.integers(4, 260, length).tolist()) for _ in range(n)]


def rl_datum(tokens, logprobs, advantages):
    d = Datum.from_tokens(tokens)
    inputs = dict(d.loss_fn_inputs)
    inputs.update(logprobs=np.asarray(logprobs, np.float32), advantages=np.asarray(advantages, np.float32))
    del inputs["weights"]
    return Datum(d.model_input, inputs)


def grads(trainer):
    return {n: p.grad.clone() for n, p in trainer.params.items() if p.grad is not None}


def test_forward_returns_logprobs_and_leaves_gradients_alone(trainer):
    data = sft_data()
    out = trainer.forward(data)
    assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [(19,)] * 4
    assert out.metrics["loss:sum"] == pytest.approx(-sum(o["logprobs"].sum() for o in out.loss_fn_outputs), rel=1e-5)
    assert all(":" in k for k in out.metrics)
    assert grads(trainer) == {}


def test_forward_backward_accumulates_until_optim_step(trainer):
    data = sft_data(4)
    trainer.forward_backward(data[:2], "cross_entropy")
    trainer.forward_backward(data[2:], "cross_entropy")
    split = grads(trainer)
    trainer.zero_grad()
    trainer.forward_backward(data, "cross_entropy")
    whole = grads(trainer)
    assert split.keys() == whole.keys() and len(whole) > 0
    for n in whole:
        torch.testing.assert_close(split[n], whole[n], rtol=1e-4, atol=1e-6)
    trainer.optim_step(AdamParams(learning_rate=1e-3))
    assert grads(trainer) == {} and trainer.step == 1


def test_forward_backward_logprobs_equal_forward(trainer):
    data = sft_data(3)
    a = trainer.forward(data)
    b = trainer.forward_backward(data, "cross_entropy")
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs):
        assert np.array_equal(x["logprobs"], y["logprobs"])


def test_optim_step_is_torch_adamw_with_decoupled_decay_and_clipping(trainer):
    adam = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.5)
    ref_params = {n: p.detach().clone().requires_grad_(True) for n, p in trainer.params.items()}
    ref_opt = torch.optim.AdamW(list(ref_params.values()), lr=1e-2, betas=(0.8, 0.9), eps=1e-8,
                                weight_decay=0.1, foreach=False)
    for step in range(2):
        trainer.forward_backward(sft_data(seed=step), "cross_entropy")
        g = grads(trainer)
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in g.values()]))
        scale = min(1.0, 0.5 / (float(total) + 1e-6))
        for n, p in ref_params.items():
            p.grad = g[n] * scale
        metrics = trainer.optim_step(adam)
        ref_opt.step()
        assert metrics["grad_norm:mean"] == pytest.approx(float(total), rel=1e-6)
    for n, p in trainer.params.items():
        torch.testing.assert_close(p.detach(), ref_params[n].detach(), rtol=1e-6, atol=1e-7)


def test_sft_loss_falls(trainer):
    data = sft_data(2, length=24)
    first = trainer.forward(data).metrics["loss:sum"]
    for _ in range(15):
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(AdamParams(learning_rate=3e-3))
    assert trainer.forward(data).metrics["loss:sum"] < 0.7 * first


def test_importance_sampling_on_policy_gradient_is_advantage_weighted_logprob(trainer):
    tokens = list(range(10, 30))
    lp = trainer.forward([Datum.from_tokens(tokens)]).loss_fn_outputs[0]["logprobs"]
    adv = np.linspace(-1, 1, len(lp)).astype(np.float32)
    out = trainer.forward_backward([rl_datum(tokens, lp, adv)], "importance_sampling")
    g_is = grads(trainer)
    trainer.zero_grad()
    # on-policy, ratio = 1: the IS gradient is that of -sum(A * lp), i.e. cross entropy with weights A
    d = Datum.from_tokens(tokens, weights=adv)
    trainer.forward_backward([d], "cross_entropy")
    g_ce = grads(trainer)
    for n in g_is:
        torch.testing.assert_close(g_is[n], g_ce[n], rtol=1e-5, atol=1e-7)
    assert out.metrics["loss:sum"] == pytest.approx(-float(adv.sum()), abs=1e-4)


@pytest.mark.parametrize(
    "data, loss, match",
    [
        (lambda: sft_data(1), "nope", "unknown loss"),
        (lambda: sft_data(1), "stable_reinforce", "stable_reinforce"),
        (lambda: [Datum((5, 6, 7), {"target_tokens": np.array([1, 2])})], "cross_entropy", "shape"),
        (lambda: [Datum((5, 6, 999), {"target_tokens": np.array([1, 2, 3])})], "cross_entropy", "outside"),
        (lambda: [Datum((5, 6, 7), {"target_tokens": np.array([1, 2, 300])})], "cross_entropy", "outside"),
        (lambda: [rl_datum([5, 6, 7], [0.0, 0.0], [np.nan, 1.0])], "importance_sampling", "NaN"),
        (lambda: [Datum.from_tokens([5, 6, 7], weights=[np.inf, 1.0])], "cross_entropy", "NaN or inf"),
        (lambda: [], "cross_entropy", "empty"),
        # trained on as logprobs of 0 before: each loss declares the inputs it needs
        (lambda: sft_data(1), "importance_sampling", r"datum 0: loss 'importance_sampling' needs .*\['logprobs'\]"),
        (lambda: [rl_datum([5, 6, 7], [0.0, 0.0], [1.0, 1.0])], "gspo", r"needs .*\['sequence_ratio_mask'\]"),
    ],
)
def test_bad_input_raises_and_changes_nothing(trainer, data, loss, match):
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    with pytest.raises(ValueError, match=match):
        trainer.forward_backward(data(), loss)
    assert grads(trainer) == {}
    trainer.optim_step(AdamParams())  # a step on no gradients leaves weights alone
    assert all(torch.equal(p, before[n]) for n, p in trainer.params.items())
