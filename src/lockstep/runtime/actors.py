"""Ray actors wrapping engine objects: Generator, Trainer and Env workers.

Each actor sets its own torch thread count (Ray would otherwise give it 1, and two actors each
taking every core oversubscribe a small machine). Weights travel as a dict of NumPy arrays through
Ray's object store: on one node the generator maps them zero-copy and swaps its parameters to
point at them between decode steps.
"""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from typing import Sequence

import numpy as np
import ray

from lockstep.runtime.types import RolloutGroup, Sample


def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def _load(model_path: str, lora_rank: int, lora_alpha: float):
    from lockstep.engine.trainer import Trainer
    from lockstep.engine.types import LoraSpec

    lora = LoraSpec(rank=lora_rank, alpha=lora_alpha) if lora_rank > 0 else None
    return Trainer.from_pretrained(model_path, lora=lora)


def _mismatch(data, outputs, sampled_from) -> dict:
    """max/mean |Δlogp|, the k3 KL estimate and the normalised ESS of trainer vs sampler logprobs."""
    train = np.concatenate([o["logprobs"][k:] for o, k in zip(outputs, sampled_from)]).astype(np.float64)
    sample = np.concatenate([d.loss_fn_inputs["logprobs"][k:] for d, k in zip(data, sampled_from)]).astype(np.float64)
    if train.size == 0:
        return {}
    delta = train - sample
    ratio = np.exp(np.clip(-delta, -20, 20))  # p_sample / p_train, for k3 = E[r - 1 - log r]
    w = np.exp(np.clip(delta, -20, 20))
    return {"mismatch_abs:max": float(np.abs(delta).max()), "mismatch_abs:mean": float(np.abs(delta).mean()),
            "mismatch_k3_kl:mean": float(np.mean(ratio - 1 + delta)),
            "mismatch_ess:mean": float(w.sum() ** 2 / (w.size * (w**2).sum()))}


@ray.remote
class TrainerActor:
    """Owns the trainable weights and the optimizer; publishes weights with integer versions."""

    def __init__(self, model_path: str, lora_rank: int, lora_alpha: float, threads: int):
        _set_threads(threads)
        self.trainer = _load(model_path, lora_rank, lora_alpha)
        self.version = 0
        self.busy_s = 0.0

    def train(self, data, loss: str, adam: dict, loss_config: dict | None = None,
              sampled_from: list[int] | None = None) -> dict:
        """One optimizer step; `sampled_from[i]` is where datum i's sampled tokens start, for the
        mismatch panel (trainer vs sampler logprobs of the same tokens)."""
        from lockstep.engine.types import AdamParams

        t = time.perf_counter()
        out = self.trainer.forward_backward(data, loss, loss_config or {})
        metrics = dict(out.metrics)
        if sampled_from is not None:
            metrics.update(_mismatch(data, out.loss_fn_outputs, sampled_from))
        metrics.update(self.trainer.optim_step(AdamParams(**adam)))
        self.version += 1
        self.busy_s += time.perf_counter() - t
        metrics["trainer_busy_s:sum"] = time.perf_counter() - t
        return metrics

    @ray.method(num_returns=2)
    def publish(self) -> tuple[int, dict[str, np.ndarray]]:
        """(version, weights); returned through the object store, so readers map it zero-copy."""
        return self.version, self.trainer.weights_numpy()

    def save_state(self, path: str, data_position) -> str:
        return str(self.trainer.save_state(path, data_position=data_position, overwrite=True))

    def export(self, path: str) -> str:
        return str(self.trainer.save_weights_for_sampler(path, kind="merged", overwrite=True))

    def set_threads(self, n: int) -> None:
        _set_threads(n)

    def stats(self) -> dict:
        return {"version": self.version, "busy_s": self.busy_s}


@ray.remote(max_concurrency=2)
class GeneratorActor:
    """Samples with the engine's sampler; accepts new weights while it decodes.

    `set_weights` runs on a second thread and only parks the new version; the decode loop picks
    it up between steps, re-prefills its active rows under the new weights, and tags later
    tokens with the new version. So every token's logprob is exactly that of the version it records.
    """

    def __init__(self, model_path: str, lora_rank: int, lora_alpha: float, threads: int):
        _set_threads(threads)
        from lockstep.engine.sampler import Sampler

        trainer = _load(model_path, lora_rank, lora_alpha)  # same module tree and parameter names
        self.params = trainer.params
        self.model = trainer.model
        self.tokenizer = trainer.tokenizer
        self.sampler = Sampler(self.model, self.tokenizer)
        self._pending: tuple[int, dict] | None = None
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.swap_latency_s: list[float] = []

    def set_weights(self, version: int, weights: dict, published_at: float) -> None:
        with self._lock:
            if self._pending is None or version > self._pending[0]:
                self._pending = (version, weights, published_at)

    def _apply_pending(self) -> bool:
        import torch

        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None or pending[0] <= self.sampler.policy_version:
            return False
        version, weights, published_at = pending
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only shared-memory arrays: we never write to them
            for name, p in self.params.items():
                p.data = torch.from_numpy(weights[name])
        self.sampler.policy_version = version
        self.swap_latency_s.append(time.time() - published_at)
        return True

    def generate(self, groups: Sequence[RolloutGroup], group_size: int, max_tokens: int,
                 temperature: float, seed: int) -> list[RolloutGroup]:
        from lockstep.engine.types import SampleRequest, SamplingParams

        t = time.perf_counter()
        self._apply_pending()
        reqs = [SampleRequest(g.prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                       seed=seed + i), num_samples=group_size)
                for i, g in enumerate(groups)]
        results = self.sampler.sample(reqs, between_steps=self._apply_pending)
        self.busy_s += time.perf_counter() - t
        out = []
        for g, r in zip(groups, results):
            samples = tuple(Sample(s.tokens, s.logprobs, s.policy_version, s.stop_reason) for s in r.sequences)
            out.append(RolloutGroup(g.group_id, g.prompt, g.problem, samples))
        return out

    def greedy(self, prompts: Sequence[tuple[int, ...]], max_tokens: int) -> tuple[int, list[tuple[int, ...]]]:
        """Greedy completions under the newest published weights: (version, completions)."""
        from lockstep.engine.types import SampleRequest, SamplingParams

        self._apply_pending()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        res = self.sampler.sample([SampleRequest(tuple(p), params) for p in prompts])
        return self.sampler.policy_version, [r.sequences[0].tokens for r in res]

    def set_threads(self, n: int) -> None:
        _set_threads(n)

    def stats(self) -> dict:
        lat = self.swap_latency_s
        return {"version": self.sampler.policy_version, "busy_s": self.busy_s,
                "swap_latency_s_max": max(lat) if lat else 0.0, "swap_latency_s_last": lat[-1] if lat else 0.0,
                "swaps": len(lat)}


@ray.remote
class EnvWorker:
    """Scores rollout groups with the env; exceptions and timeouts are retried, then counted."""

    def __init__(self, tokenizer_dir: str, max_tokens: int, retries: int = 2, timeout_s: float = 30.0):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.max_tokens = max_tokens
        self.retries = retries
        self.timeout_s = timeout_s
        self.busy_s = 0.0

    async def _score_one(self, problem, tokens) -> tuple[float, dict, bool]:
        from lockstep.envs.arithmetic import ArithmeticEnv

        for attempt in range(self.retries + 1):
            try:
                env = ArithmeticEnv(problem, self.tokenizer, max_tokens=self.max_tokens)
                await asyncio.wait_for(env.initial_observation(), self.timeout_s)
                result = await asyncio.wait_for(env.step(list(tokens)), self.timeout_s)
                return float(result.reward), dict(result.metrics), True
            except Exception:  # noqa: BLE001 - any env failure is retried, then counted, never fatal
                continue
        return 0.0, {}, False

    async def score(self, groups: Sequence[RolloutGroup]) -> tuple[list[RolloutGroup], int]:
        t = time.perf_counter()
        out, failures = [], 0
        for g in groups:
            scored = []
            for s in g.samples:
                reward, metrics, ok = await self._score_one(g.problem, s.tokens)
                failures += not ok
                scored.append(Sample(s.tokens, s.logprobs, s.version, s.stop_reason, reward, metrics))
            out.append(RolloutGroup(g.group_id, g.prompt, g.problem, tuple(scored)))
        self.busy_s += time.perf_counter() - t
        return out, failures
