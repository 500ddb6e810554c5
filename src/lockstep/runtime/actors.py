"""Ray actors wrapping engine objects: Generator, Trainer and Env workers.

Each actor sets its own torch thread count (Ray would otherwise give it 1, and two actors each
taking every core oversubscribe a small machine). Weights travel as a dict of NumPy arrays through
Ray's object store: on one node the generator maps them zero-copy and swaps its parameters to
point at them between decode steps. Every actor reports an `incarnation` id in `stats()`, so the
controller can tell that Ray restarted it (and must give it weights again). A restarted trainer
or generator refuses the calls that need its lost state (ActorRestarted) until it is given it
again, so a restart that happens between two calls is noticed rather than trained or sampled on.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import warnings
from typing import Sequence

import numpy as np
import ray

from lockstep.runtime.episodes import run_episodes
from lockstep.runtime.types import ActorRestarted


def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def _node() -> str:
    """The Ray node this actor runs on (its id), as placement metrics report it."""
    return ray.get_runtime_context().get_node_id()


def _reconstructed() -> bool:
    """Whether Ray restarted this actor: whatever the controller had given it is gone."""
    return ray.get_runtime_context().was_current_actor_reconstructed


def _load(model_path: str, lora_rank: int, lora_alpha: float, train_experts=None, device: str = "cpu",
          dtype: str = "float32"):
    from lockstep.engine.device import Compute
    from lockstep.engine.trainer import Trainer
    from lockstep.engine.types import LoraSpec

    lora = LoraSpec(rank=lora_rank, alpha=lora_alpha) if lora_rank > 0 else None
    return Trainer.from_pretrained(model_path, lora=lora, train_experts=train_experts, compute=Compute(device, dtype))


def _fingerprint(trainer):
    """This process's ForwardFingerprint (engine/fingerprint.py), on the weights just loaded: what
    the controller compares between the trainer and every other component that runs the model."""
    from lockstep.engine.fingerprint import forward_fingerprint

    return forward_fingerprint(trainer.model)


def _mismatch(data, outputs, sampled_from) -> dict:
    """max/mean |Δlogp|, the k3 KL estimate and the normalised ESS of trainer vs sampler logprobs,
    over the sampled tokens (weights > 0 from `sampled_from[i]` on)."""
    train, sample = [], []
    for d, o, k in zip(data, outputs, sampled_from):
        keep = d.loss_fn_inputs["weights"][k:] > 0
        train.append(o["logprobs"][k:][keep])
        sample.append(d.loss_fn_inputs["logprobs"][k:][keep])
    train, sample = np.concatenate(train).astype(np.float64), np.concatenate(sample).astype(np.float64)
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
    """Owns the trainable weights and the optimizer; publishes weights with integer versions
    (the version is the optimizer step, so it survives a checkpoint round trip)."""

    def __init__(self, model_path: str, lora_rank: int, lora_alpha: float, threads: int, train_experts=None,
                 replicas: int = 1, micro_batches: int = 1, replica_cpus: float = 1.0, device: str = "cpu",
                 dtype: str = "float32", replica_gpus: float = 0.0):
        _set_threads(threads)
        self.trainer = _load(model_path, lora_rank, lora_alpha, train_experts, device, dtype)
        self.forward = _fingerprint(self.trainer)
        self.busy_s = 0.0
        self.incarnation = uuid.uuid4().hex
        self.state_lost = _reconstructed()
        """True after a restart until load_state or start_fresh: the base weights are not the run's."""
        self.lineage = uuid.uuid4().hex
        """The branch of training these weights are on: new at every start_fresh and load_state, so
        after a rollback a version number met again names other weights (see publish)."""
        self.micro, self.helpers, self.dp = micro_batches, [], None
        if replicas > 1 or micro_batches > 1:
            self._start_replicas(replicas, replica_cpus, replica_gpus,
                                 (model_path, lora_rank, lora_alpha, threads, train_experts, device, dtype))
        self.rank_forwards = tuple(ray.get([h.fingerprint.remote() for h in self.helpers]))
        """Ranks 1.. of a data-parallel trainer: their fingerprints, compared like the replicas'."""

    def _start_replicas(self, replicas: int, cpus: float, gpus: float, load_args: tuple) -> None:
        """Rank 0 of `replicas` trainer processes: the others are actors this one owns (they die
        with it), joined in one gloo group on this node's address."""
        from lockstep.engine.data_parallel import DataParallel, init_group

        if replicas > 1:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            address, port = ray.util.get_node_ip_address(), _free_port()
            # On this node when it has room (the gradient chain is then loopback traffic); soft,
            # so a full node places a replica elsewhere rather than waiting.
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
            self.helpers = [TrainerReplica.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=here).remote(
                *load_args, rank, replicas, address, port) for rank in range(1, replicas)]
            init_group(0, replicas, address, port, device=load_args[5])  # returns once every replica has joined
        self.dp = DataParallel(self.trainer, rank=0, world=replicas)

    def _require_state(self) -> None:
        if self.state_lost:
            raise ActorRestarted("the trainer was restarted and lost its weights and optimizer state")

    def start_fresh(self) -> None:
        """The run starts from the base model: the weights this incarnation loaded are the ones."""
        self.state_lost = False
        self.lineage = uuid.uuid4().hex

    def train(self, data, loss: str, adam: dict, loss_config: dict | None = None,
              sampled_from: list[int] | None = None) -> dict:
        """One optimizer step; `sampled_from[i]` is where datum i's sampled tokens start, for the
        mismatch panel (trainer vs sampler logprobs of the same tokens)."""
        from lockstep.engine.types import AdamParams

        self._require_state()
        t = time.perf_counter()
        if self.dp is None:
            out = self.trainer.forward_backward(data, loss, loss_config or {})
            metrics, outputs = dict(out.metrics), out.loss_fn_outputs
        else:
            metrics, outputs = self._train_parallel(data, loss, loss_config or {}, adam)
        if sampled_from is not None:
            metrics.update(_mismatch(data, outputs, sampled_from))
        metrics.update(self.trainer.optim_step(AdamParams(**adam)))
        self.busy_s += time.perf_counter() - t
        metrics["trainer_busy_s:sum"] = time.perf_counter() - t
        return metrics

    def _train_parallel(self, data, loss: str, loss_config: dict, adam: dict) -> tuple[dict, list]:
        """Micro-batches over the replicas (each takes the same optimizer step after this); the
        merged metrics and every datum's outputs, in order."""
        from lockstep.engine.data_parallel import merge_metrics, micro_split

        parts = micro_split(data, self.micro)
        refs = [h.step.remote(parts, loss, loss_config, adam) for h in self.helpers]
        mine: list | Exception
        try:
            mine = [(o.metrics, o.loss_fn_outputs) for o in self.dp.forward_backward(parts, loss, loss_config)]
        except Exception as e:  # noqa: BLE001 - raised below, once every replica's call is back
            mine = e
        outcomes = [mine, *_replica_outcomes(refs)]  # never leave a replica's call behind
        failed = [o for o in outcomes if isinstance(o, Exception)]
        if failed:  # every rank failed the step: raise the error of the rank where it failed
            from lockstep.engine.data_parallel import PeerFailed, PeerRefused

            raise next((e for e in failed if not isinstance(e, (PeerFailed, PeerRefused))), failed[0])
        done = [part for o in outcomes for part in o]  # contiguous shares in rank order: micro-batch order
        weights = [float(sum((d.loss_fn_inputs["weights"] > 0).sum() for d in part)) for part in parts]
        metrics = merge_metrics([(m, w) for (m, _), w in zip(done, weights)])
        return metrics, [o for _, outs in done for o in outs]

    @ray.method(num_returns=3)
    def publish(self) -> tuple[int, str, dict[str, np.ndarray]]:
        """(version, lineage, weights); returned through the object store, so readers map it
        zero-copy. A version alone does not name the weights: a rollback to a checkpoint trains
        the same versions again, so a replica compares (version, lineage)."""
        self._require_state()
        return self.trainer.step, self.lineage, self.trainer.weights_numpy()

    def save_state(self, path: str, data_position) -> str:
        self._require_state()
        return str(self.trainer.save_state(path, data_position=data_position, overwrite=True))

    def load_state(self, path: str) -> dict:
        """Weights, optimizer, RNG and step from a checkpoint; returns its data position."""
        self.trainer.load_state(path)
        ray.get([h.load_state.remote(path) for h in self.helpers])  # every replica holds the same state
        self.state_lost = False
        self.lineage = uuid.uuid4().hex
        return self.trainer.data_position

    def export(self, path: str) -> str:
        self._require_state()
        return str(self.trainer.save_weights_for_sampler(path, kind="merged", overwrite=True))

    def set_threads(self, n: int) -> None:
        _set_threads(n)
        ray.get([h.set_threads.remote(n) for h in self.helpers])

    def stats(self) -> dict:
        return {"version": self.trainer.step, "busy_s": self.busy_s, "incarnation": self.incarnation,
                "replicas": 1 + len(self.helpers), "node": _node(),
                "forward": self.forward, "rank_forwards": self.rank_forwards}


@ray.remote
class TrainerReplica:
    """Rank > 0 of a data-parallel trainer (engine/data_parallel.py), owned by the TrainerActor
    that is rank 0: it computes its share of each step's micro-batches, takes the same optimizer
    step, and never publishes or checkpoints (rank 0 does, once)."""

    def __init__(self, model_path: str, lora_rank: int, lora_alpha: float, threads: int, train_experts,
                 device: str, dtype: str, rank: int, world: int, address: str, port: int):
        from lockstep.engine.data_parallel import DataParallel, init_group

        _set_threads(threads)
        self.trainer = _load(model_path, lora_rank, lora_alpha, train_experts, device, dtype)
        self.forward = _fingerprint(self.trainer)
        init_group(rank, world, address, port, device=device)
        self.dp = DataParallel(self.trainer, rank=rank, world=world)

    def step(self, parts, loss: str, loss_config: dict, adam: dict) -> list[tuple[dict, list]]:
        from lockstep.engine.types import AdamParams

        outs = self.dp.forward_backward(parts, loss, loss_config)
        self.trainer.optim_step(AdamParams(**adam))
        return [(o.metrics, o.loss_fn_outputs) for o in outs]

    def load_state(self, path: str) -> None:
        self.trainer.load_state(path)

    def fingerprint(self):
        return self.forward

    def set_threads(self, n: int) -> None:
        _set_threads(n)


def _replica_outcomes(refs) -> list:
    """Each replica's step() result, or the exception it raised, in rank order."""
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayActorError:
            # A replica is gone, and with it the process group: this trainer cannot step again.
            # Ending this process makes Ray restart it (with new replicas), which the controller
            # sees as a lost trainer and answers by rolling back to the last checkpoint.
            warnings.warn("a trainer replica died; restarting the trainer and its replicas")
            os._exit(70)
        except ray.exceptions.RayTaskError as e:  # as raised, an instance of the replica's own error too
            out.append(e)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((ray.util.get_node_ip_address(), 0))
        return s.getsockname()[1]


@ray.remote(concurrency_groups={"weights": 1, "sample": 1, "control": 1})
class GeneratorActor:
    """Samples with the engine's sampler; accepts new weights while it decodes.

    Three concurrency groups: `sample` runs one sampling call at a time (calls from several env
    workers queue), `weights` runs `set_weights` / `stats` alongside it, and `control` the calls
    that block until the decode loop reaches a point (`until_swapped`, `until_held`). `set_weights`
    only parks the new version; the decode loop picks it up between steps, re-prefills its active
    rows under the new weights, and tags later tokens with the new version. So every token's
    logprob is exactly that of the version it records. A swap stalls this replica's decoding for
    the re-prefill (and, in a fleet-wide pause, for the wait at the barrier): `stats()` reports
    each stall (decoding stopped -> the next decode step).
    """

    def __init__(self, model_path: str, lora_rank: int, lora_alpha: float, threads: int, speculative=None,
                 device: str = "cpu", dtype: str = "float32"):
        """speculative: a config SpeculativeSpec (None: plain decoding)."""
        _set_threads(threads)
        from lockstep.engine.drafters import make_drafter
        from lockstep.engine.sampler import Sampler

        trainer = _load(model_path, lora_rank, lora_alpha, None, device, dtype)  # same module tree and parameter names
        self.forward = _fingerprint(trainer)
        self.params = trainer.params
        drafter = make_drafter(speculative.drafter, target=trainer.model, tokenizer=trainer.tokenizer,
                               **speculative.drafter_options()) if speculative else None
        self.sampler = Sampler(trainer.model, trainer.tokenizer, drafter=drafter,
                               **(speculative.sampler_options() if speculative else {}))
        self._pending: tuple | None = None
        self._cond = threading.Condition()
        self._sampling = self._hold = self._held = False
        self._stall_from: float | None = None
        self.busy_s = 0.0
        self.requests = 0
        self.swap_latency_s: list[float] = []
        self.stalls_s: list[float] = []
        self.incarnation = uuid.uuid4().hex
        self.weights_lost = _reconstructed()
        """True after a restart until set_weights: the base weights are not the policy's."""
        self.lineage: str | None = None
        """The trainer's branch (TrainerActor.lineage) of the weights in use; None: the base model
        as loaded, of no branch yet."""

    @ray.method(concurrency_group="weights")
    def set_weights(self, version: int, weights: dict, published_at: float, lineage: str | None) -> None:
        """Park weights for the next decode step. The controller orders its calls, so the last
        call is always the newest weights (after a rollback to a checkpoint, a lower version, or
        the same version again on the new branch: `lineage` tells them apart)."""
        with self._cond:
            self._pending = (version, lineage, weights, published_at)
            self.weights_lost = False
            self._cond.notify_all()

    def _apply_pending(self) -> bool:
        import torch

        with self._cond:
            pending, self._pending = self._pending, None
            self._cond.notify_all()
        # The version alone is not enough: parked weights overwritten while idle (v0 after a
        # rollback, then v1 of the new branch) would meet the discarded branch's v1 in use.
        if pending is None or pending[:2] == (self.sampler.policy_version, self.lineage):
            return False
        version, lineage, weights, published_at = pending
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only shared-memory arrays: we never write to them
            for name, p in self.params.items():  # on a GPU replica, one host-to-device copy
                w = torch.from_numpy(weights[name])
                p.data = w if p.device.type == "cpu" else w.to(p.device)
        self.sampler.policy_version, self.lineage = version, lineage
        self.swap_latency_s.append(time.time() - published_at)
        return True

    def _wait_out_hold(self) -> float | None:
        """Block while a fleet-wide pause holds this replica; when it held, the time it stopped."""
        with self._cond:
            if not self._hold:
                return None
            stopped, self._held = time.perf_counter(), True
            self._cond.notify_all()
            while self._hold:
                self._cond.wait()
            self._held = False
            return stopped

    def _between_steps(self) -> bool:
        """The decode loop's hook: close the last stall, wait out a pause, swap parked weights."""
        now = time.perf_counter()
        if self._stall_from is not None:  # the re-prefill after the last swap is done
            self.stalls_s.append(now - self._stall_from)
            self._stall_from = None
        stopped = self._wait_out_hold()
        swapped = self._apply_pending()
        if swapped:
            self._stall_from = stopped or now
        elif stopped is not None:
            self.stalls_s.append(time.perf_counter() - stopped)
        return swapped

    @ray.method(concurrency_group="sample")
    def sample(self, requests: Sequence) -> list:
        """Engine SampleRequests -> SampleResults, under the newest weights (hot-swapped mid-call)."""
        if self.weights_lost:
            raise ActorRestarted("the generator was restarted and has not been given the policy's weights yet")
        t = time.perf_counter()
        self.requests += len(requests)
        with self._cond:
            self._sampling = True
        try:
            stopped = self._wait_out_hold()  # a call that arrives during a pause waits it out
            if stopped is not None:
                self.stalls_s.append(time.perf_counter() - stopped)
            self._apply_pending()  # nothing is decoding yet: no re-prefill, no stall
            return self.sampler.sample(list(requests), between_steps=self._between_steps)
        finally:
            if self._stall_from is not None:  # swapped on the call's last step
                self.stalls_s.append(time.perf_counter() - self._stall_from)
                self._stall_from = None
            with self._cond:
                self._sampling = False
                self._cond.notify_all()
            self.busy_s += time.perf_counter() - t

    def _until(self, ready, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(ready, timeout)

    @ray.method(concurrency_group="control")
    def until_swapped(self, timeout: float) -> bool:
        """Return once parked weights are in use, or would be by the next call (not sampling)."""
        return self._until(lambda: self._pending is None or not self._sampling, timeout)

    @ray.method(concurrency_group="control")
    def hold(self) -> None:
        """Stop decoding at the next step boundary (and start no call) until release()."""
        with self._cond:
            self._hold = True

    @ray.method(concurrency_group="control")
    def until_held(self, timeout: float) -> bool:
        """Return once this replica has stopped decoding for a hold (or is not sampling)."""
        return self._until(lambda: self._held or not self._sampling, timeout)

    @ray.method(concurrency_group="control")
    def release(self) -> None:
        with self._cond:
            self._hold = False
            self._cond.notify_all()

    @ray.method(concurrency_group="sample")
    def set_threads(self, n: int) -> None:
        _set_threads(n)  # in the sampling group: never changes the pool mid-forward

    @ray.method(concurrency_group="weights")
    def stats(self) -> dict:
        lat, stalls = self.swap_latency_s, self.stalls_s
        return {"version": self.sampler.policy_version, "lineage": self.lineage, "busy_s": self.busy_s,
                "incarnation": self.incarnation,
                "swap_latency_s_max": max(lat) if lat else 0.0, "swap_latency_s_last": lat[-1] if lat else 0.0,
                "swaps": len(lat), "stalls": len(stalls), "stall_s_max": max(stalls) if stalls else 0.0,
                "stall_s_sum": sum(stalls), "requests": self.requests, "sampling": self._sampling, "held": self._held,
                "node": _node(), "forward": self.forward,
                "speculative": self.sampler.speculation_stats()}


def _log_envs_to(path: str) -> None:
    """Env failures (logger lockstep.envs) appended to `path`: this process's stderr is Ray's, which
    a run does not show (log_to_driver=False keeps its console to the progress lines)."""
    import logging

    envs = logging.getLogger("lockstep.envs")
    if any(getattr(h, "baseFilename", None) == path for h in envs.handlers):
        return
    try:
        handler = logging.FileHandler(path)
    except OSError as e:  # another node of a cluster, without the run directory: stderr (Ray's log) only
        envs.warning("env failures go to this worker's stderr only: cannot open %s (%s)", path, e)
        return
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    envs.addHandler(handler)


@ray.remote
class EnvWorker:
    """Rolls groups out: runs each episode's envs, asking the generator for every turn's tokens.

    Env exceptions and timeouts are retried (from a snapshot when the env can fork), then the
    sample counts as failed; they never crash the run. Each failure's traceback goes to `log_path`
    (the run's envs.log; rate-limited, see episodes.RateLimitedLog).
    """

    def __init__(self, tokenizer_dir: str, generator_prefix: str, *, retries: int, timeout_s: float,
                 call_timeout_s: float, log_path: str | None = None):
        """Generator replica i is the actor named `generator_prefix` + fleet.replica_name(i),
        looked up when first routed to: the allocator adds replicas during the run, and names
        (not handles) let Ray restart this actor without constructor arguments in the object store."""
        from transformers import AutoTokenizer

        if log_path:
            _log_envs_to(log_path)

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.generator_prefix = generator_prefix
        self.generators: dict[int, object] = {}
        self.retries, self.timeout_s, self.call_timeout_s = retries, timeout_s, call_timeout_s
        self.busy_s = 0.0
        self.active = 0
        """Rollouts started and not yet returned (what a retiring worker finishes first)."""
        self.incarnation = uuid.uuid4().hex

    async def _sample(self, requests, replicas: Sequence[int]):
        """Each request on its group's replica (the router's choice), the replicas concurrently;
        the results in request order."""
        import asyncio

        by_replica: dict[int, list[int]] = {}
        for i, r in enumerate(replicas):
            by_replica.setdefault(r, []).append(i)
        refs = {r: self._generator(r).sample.remote([requests[i] for i in idx]) for r, idx in by_replica.items()}
        done = await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(ref.future()) for ref in refs.values())),
                                      self.call_timeout_s)
        out: list = [None] * len(requests)
        for idx, results in zip(by_replica.values(), done):
            for i, result in zip(idx, results):
                out[i] = result
        return out

    def _generator(self, replica: int):
        if replica not in self.generators:
            from lockstep.runtime.fleet import replica_name

            self.generators[replica] = ray.get_actor(self.generator_prefix + replica_name(replica))
        return self.generators[replica]

    async def rollout(self, request) -> list:
        """A RolloutRequest -> RolloutGroups with rewards, tokens, exact logprobs and versions."""
        routes = request.routes or (0,) * len(request.group_ids)

        async def sample(requests, groups):
            return await self._sample(requests, [routes[g] for g in groups])

        self.active += 1
        try:
            groups, env_s = await run_episodes(request, self.tokenizer, sample, retries=self.retries,
                                               timeout_s=self.timeout_s)
        finally:
            self.active -= 1
        self.busy_s += env_s
        return groups

    async def drain(self) -> None:
        """Return once every rollout started before this call has returned: a worker the allocator
        retires is sent no new rollout, and is stopped only after this (nothing in flight is lost).
        Ray starts an async actor's calls in the order they were sent, so every earlier rollout is
        counted in `active` by the time this runs."""
        import asyncio

        while self.active:
            await asyncio.sleep(0.05)

    def stats(self) -> dict:
        return {"busy_s": self.busy_s, "incarnation": self.incarnation, "node": _node()}
