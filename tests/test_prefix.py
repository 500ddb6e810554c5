"""Shared-prefix training: same logprobs bit for bit as the plain forward, gradients to match."""

import numpy as np
import pytest
import torch

from lockstep.engine.prefix import MIN_SHARED, plan_prefixes
from lockstep.engine.sampler import Sampler
from lockstep.engine.trainer import Trainer
from lockstep.engine.types import Datum, LoraSpec, SampleRequest, SamplingParams


def test_plan_groups_neighbours_and_leaves_every_datum_a_suffix():
    a, b = (5, 6, 7, 8, 9), (5, 6, 7, 8, 1, 2)
    plan = plan_prefixes([a + (1,), b, a + (2,), (40, 41, 42)])
    assert plan.prefixes == ((5, 6, 7, 8),)
    assert plan.shared == (4, 4, 4, 0) and plan.owner == (0, 0, 0, 1)  # 1 = the empty row
    same = plan_prefixes([a, a])
    assert same.shared == (4, 4)  # identical inputs still keep one suffix token each
    assert plan_prefixes([(1, 2, 3, 9), (1, 2, 3, 8)]) is None  # 3 < MIN_SHARED tokens in common
    assert MIN_SHARED == 4 and plan_prefixes([a]) is None


def grpo_like(tok, rng, groups=3, size=4):
    data = []
    for g in range(groups):
        prompt = tok.encode(f"{g}{g}7+04{g}=")
        for _ in range(size):
            completion = rng.integers(4, 60, rng.integers(1, 6)).tolist()
            full = prompt + completion
            n = len(prompt) - 1
            data.append(Datum.from_tokens(full, weights=[0.0] * n + [1.0] * len(completion),
                                          advantages=[0.0] * n + [float(rng.normal())] * len(completion),
                                          logprobs=[0.0] * n + [-1.0] * len(completion)))
    unshared = tok.encode("unshared")
    zeros = [0.0] * (len(unshared) - 1)  # trains nothing (importance_sampling needs both inputs)
    data.append(Datum.from_tokens(unshared, advantages=zeros, logprobs=zeros))
    return data


@pytest.mark.parametrize("lora", [False, True])
def test_shared_and_plain_forward_agree(builtin_dir, lora):
    trainer = Trainer.from_pretrained(builtin_dir, lora=LoraSpec(rank=4) if lora else None)
    data = grpo_like(trainer.tokenizer, np.random.default_rng(0))
    assert plan_prefixes([d.model_input for d in data]) is not None
    grads, outs = [], []
    for share in (True, False):
        trainer.share_prefixes = share
        out = trainer.forward_backward(data, "importance_sampling")
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in trainer.params.items()})
        trainer.zero_grad()
    for a, b in zip(outs[0].loss_fn_outputs, outs[1].loss_fn_outputs):
        np.testing.assert_array_equal(a["logprobs"], b["logprobs"])  # bit for bit
    assert outs[0].metrics["loss:sum"] == outs[1].metrics["loss:sum"]
    assert outs[0].metrics["entropy:mean"] == pytest.approx(outs[1].metrics["entropy:mean"], rel=1e-6)
    for name in grads[0]:  # the same gradient, summed in another order
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6)


def test_shared_forward_equals_the_samplers_logprobs(builtin_dir):
    trainer = Trainer.from_pretrained(builtin_dir)
    sampler = Sampler(trainer.model, trainer.tokenizer)
    prompt = tuple(trainer.tokenizer.encode("123+456="))
    [res] = sampler.sample([SampleRequest(prompt, SamplingParams(max_tokens=6, seed=3, stop=()), num_samples=8)])
    data = [Datum.from_tokens(list(prompt) + list(s.tokens)) for s in res.sequences]
    assert plan_prefixes([d.model_input for d in data]) is not None
    out = trainer.forward(data)
    for o, s in zip(out.loss_fn_outputs, res.sequences):
        np.testing.assert_array_equal(o["logprobs"][len(prompt) - 1 :], np.array(s.logprobs, np.float32))
