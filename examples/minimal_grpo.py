"""A minimal GRPO loop on the public API, in one process (no Ray): the whole algorithm on a page.

    .venv/bin/python examples/minimal_grpo.py --sft-steps 600 --sft-target 0.3 --rl-steps 150

Warm up with cross-entropy on arithmetic, then: sample 8 answers per prompt, reward exact matches,
centre rewards per group, and take an importance_sampling step on the sampler's exact logprobs.
"""

from __future__ import annotations

import argparse

import numpy as np

from lockstep.advantages import grpo_advantages
from lockstep.engine.sampler import Sampler
from lockstep.engine.tiny import ensure_tiny_model
from lockstep.engine.trainer import Trainer
from lockstep.engine.types import AdamParams, Datum, SampleRequest, SamplingParams
from lockstep.envs.arithmetic import ArithmeticTask, is_correct


def accuracy(sampler, tok, task) -> float:
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    results = sampler.sample([SampleRequest(tuple(tok.encode(p.prompt)), greedy) for p in task.heldout])
    return float(np.mean([is_correct(p, r.sequences[0].tokens, tok) for p, r in zip(task.heldout, results)]))


def main(sft_steps: int, rl_steps: int, sft_target: float = 0.0) -> tuple[float, float, int]:
    """(accuracy after the warm-up, after GRPO, optimizer steps). With `sft_target`, the warm-up
    stops once held-out accuracy reaches it (checked every 5 steps), as the embedded default's
    does: at 3e-3 the accuracy swings (0.08 to 0.44 within 10 steps), so a fixed step count lands
    on a different point of the swing on another CPU."""
    trainer = Trainer.from_pretrained(ensure_tiny_model())
    tok, task = trainer.tokenizer, ArithmeticTask(num_heldout=200)
    sampler = Sampler(trainer.model, tok)  # same weights object: always on-policy here
    adam = AdamParams(learning_rate=3e-3, beta2=0.99, eps=1e-8, grad_clip_norm=1.0)
    for step in range(sft_steps):
        data = []
        for p in task.problems(step, 128, stream="sft"):
            prompt, answer = tok.encode(p.prompt), tok.encode(p.answer) + [tok.eos_token_id]
            data.append(Datum.from_tokens(prompt + answer, [0.0] * (len(prompt) - 1) + [1.0] * len(answer)))
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(adam)
        if sft_target and (step + 1) % 5 == 0 and accuracy(sampler, tok, task) >= sft_target:
            break
    after_sft = accuracy(sampler, tok, task)
    adam = AdamParams(learning_rate=2e-4, beta2=0.99, eps=1e-8, grad_clip_norm=1.0)
    for step in range(rl_steps):
        problems = task.problems(step, 16, stream="rl")
        reqs = [SampleRequest(tuple(tok.encode(p.prompt)), SamplingParams(max_tokens=6, seed=step * 100 + i), num_samples=8)
                for i, p in enumerate(problems)]
        data = []
        for p, req, res in zip(problems, reqs, sampler.sample(reqs)):
            rewards = np.array([float(is_correct(p, s.tokens, tok)) for s in res.sequences])
            for s, a in zip(res.sequences, grpo_advantages(rewards)):
                n = len(req.prompt)
                data.append(Datum(tuple(req.prompt + s.tokens[:-1]), {
                    "target_tokens": np.array(req.prompt[1:] + s.tokens),
                    "logprobs": np.array([0.0] * (n - 1) + list(s.logprobs), np.float32),
                    "advantages": np.array([0.0] * (n - 1) + [a] * len(s.tokens), np.float32)}))
        trainer.forward_backward(data, "importance_sampling")
        trainer.optim_step(adam)
    return after_sft, accuracy(sampler, tok, task), trainer.step


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft-steps", type=int, default=600)
    ap.add_argument("--rl-steps", type=int, default=150)
    ap.add_argument("--sft-target", type=float, default=0.3, help="end the warm-up at this held-out accuracy")
    a = ap.parse_args()
    sft, final, _ = main(a.sft_steps, a.rl_steps, a.sft_target)
    print(f"held-out greedy accuracy: after SFT {sft:.2f}, after GRPO {final:.2f}")
