"""The controller: wires Ray actors into the Generate -> Reward -> Train -> Update loop.

            prompts (ArithmeticTask batches of groups)
                 |
                 v
   +----------------------+  groups: tokens + exact sampler logprobs + version per sample
   | GeneratorActor       |-------------------------------+
   | KV cache, prefix     |                               v
   | sharing, hot-swap    |                  +----------------------+
   +----------^-----------+                  | EnvWorker pool       | rewards (retried, counted)
              | weights v+1 (object store,   +----------+-----------+
              | zero-copy)                              v
   +----------+-----------+              +------------------------------+
   | publish (version)    |              | clean(): staleness gate,     | zero-variance dropped and
   +----------^-----------+              | truncation, repetition flags | refilled, counts reported
              |                          +----------+-------------------+
   +----------+-----------+                         v
   | TrainerActor         |<---- datums (GRPO advantages, IS loss) ----+
   +----------------------+

Contract of the RL loop: it keeps up to `max_staleness + 1` generation batches in flight (so with
0 it is synchronous on-policy), consumes finished batches in order, waits only on the oldest, and
trains whenever `prompts_per_step` clean groups are buffered. Every remote call has a deadline.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import ray

from lockstep.config.types import RunSpec, StageSpec
from lockstep.envs.arithmetic import ArithmeticTask, is_correct
from lockstep.runtime.filters import clean, to_datums, too_stale
from lockstep.runtime.types import RolloutGroup


MAX_REFILL_BATCHES = 4
"""Dynamic sampling draws at most this many batches per step before completing the batch with
zero-variance groups (zero advantage, so no gradient) rather than waiting forever."""


class ComponentError(RuntimeError):
    """A component failed or missed its deadline."""


def wait(ref, timeout: float, what: str):
    """ray.get with a deadline: a hang or a dead actor becomes a clear error, never a stall."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise ComponentError(f"{what} did not answer within {timeout:.0f}s (runtime.call_timeout_s)") from None
    except ray.exceptions.RayActorError as e:
        raise ComponentError(f"{what}: the actor died ({e.__class__.__name__}); see the Ray worker logs") from e


@dataclass
class Components:
    trainer: "ray.actor.ActorHandle"
    generator: "ray.actor.ActorHandle"
    envs: list
    tokenizer: object
    task: ArithmeticTask
    timeout: float
    version: int = 0
    env_turn: int = 0
    stats: dict = field(default_factory=lambda: collections.defaultdict(float))

    def publish(self) -> None:
        """Put the trainer's weights in the object store and point the generator at them."""
        version_ref, weights_ref = self.trainer.publish.remote()
        self.version = wait(version_ref, self.timeout, "trainer.publish")
        # Parking the weights is instant; waiting for it orders it before the next generate call
        # (a threaded actor does not order calls), which keeps max_staleness=0 truly on-policy.
        wait(self.generator.set_weights.remote(self.version, weights_ref, time.time()), self.timeout, "generator.set_weights")

    def score(self, groups):
        env = self.envs[self.env_turn % len(self.envs)]
        self.env_turn += 1
        return env.score.remote(groups)


def evaluate(c: Components, max_tokens: int) -> float:
    """Greedy held-out accuracy under the newest published weights."""
    prompts = [tuple(c.tokenizer.encode(p.prompt)) for p in c.task.heldout]
    version, outs = wait(c.generator.greedy.remote(prompts, max_tokens), c.timeout, "generator.greedy")
    return sum(is_correct(p, t, c.tokenizer) for p, t in zip(c.task.heldout, outs)) / len(c.task.heldout)


def sft_datums(c: Components, step: int, batch_size: int):
    from lockstep.engine.types import Datum

    eos = c.tokenizer.eos_token_id
    data = []
    for p in c.task.problems(step, batch_size, stream="sft"):
        prompt, answer = c.tokenizer.encode(p.prompt), c.tokenizer.encode(p.answer) + [eos]
        data.append(Datum.from_tokens(prompt + answer, weights=[0.0] * (len(prompt) - 1) + [1.0] * len(answer)))
    return data


def make_groups(c: Components, batch_index: int, count: int) -> list[RolloutGroup]:
    problems = c.task.problems(batch_index, count, stream="rl")
    return [RolloutGroup(f"rl-{batch_index}-{i}", tuple(c.tokenizer.encode(p.prompt)), p)
            for i, p in enumerate(problems)]


def staleness_histogram(batch, trainer_version: int) -> dict[str, int]:
    """Samples per staleness (trainer version minus the sample's oldest token version), and the max."""
    ages = [trainer_version - s.version for g in batch for s in g.samples]
    hist = {f"staleness/{a}": ages.count(a) for a in sorted(set(ages))}
    return {**hist, "rollout/staleness_max": max(ages)}


def adam(stage: StageSpec) -> dict:
    return {"learning_rate": stage.learning_rate, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "grad_clip_norm": 1.0}


def rl_stage(c: Components, stage: StageSpec, spec: RunSpec, on_step, should_stop) -> int:
    """The RL loop (see the module docstring for its contract). Returns steps taken."""
    in_flight: collections.deque = collections.deque()
    buffer: list[RolloutGroup] = []
    spare: list[RolloutGroup] = []
    next_batch, step, refills = 0, 0, 0
    while step < stage.steps and not should_stop(step):
        while len(in_flight) < stage.max_staleness + 1:  # keep the generator busy, within bound
            groups = make_groups(c, next_batch, stage.prompts_per_step)
            gen = c.generator.generate.remote(groups, stage.group_size, spec.env.max_tokens,
                                              stage.temperature, spec.seed * 1_000_003 + next_batch)
            in_flight.append(c.score(gen))
            next_batch += 1
        t_wait = time.perf_counter()
        scored, env_failures = wait(in_flight.popleft(), c.timeout, "generate+score")
        report = clean(scored, trainer_version=c.version, max_staleness=stage.max_staleness)
        buffer.extend(report.kept)
        spare.extend(report.no_signal)
        c.stats["wait_s"] += time.perf_counter() - t_wait
        counts = {"filter/zero_variance": report.zero_variance, "filter/truncated": report.truncated,
                  "filter/repetitive": report.repetitive, "filter/stale": report.stale,
                  "env/failures": env_failures}
        for k, v in counts.items():
            c.stats[k] += v
        refills += 1
        if len(buffer) < stage.prompts_per_step and refills < MAX_REFILL_BATCHES:
            continue  # dynamic sampling: refill before training
        if len(buffer) < stage.prompts_per_step:  # out of refills: complete with no-signal groups
            c.stats["filter/underfilled_steps"] += 1
            buffer.extend(spare[: stage.prompts_per_step - len(buffer)])
        refills, spare = 0, []
        batch, buffer = buffer[: stage.prompts_per_step], buffer[stage.prompts_per_step :]
        fresh = [g for g in buffer if not too_stale(g, c.version + 1, stage.max_staleness)]
        c.stats["filter/stale"] += len(buffer) - len(fresh)  # leftovers would be too old next step
        buffer = fresh
        data, starts = to_datums(batch, estimator=stage.advantage)
        metrics = wait(c.trainer.train.remote(data, stage.loss, adam(stage), None, starts), c.timeout, "trainer.train")
        c.publish()
        step += 1
        trained_at = c.version - 1  # the version the trainer held during this step
        queues = {"queue/in_flight_batches": len(in_flight), "queue/buffered_groups": len(buffer)}
        on_step(step, batch, metrics, {**counts, **queues, **staleness_histogram(batch, trained_at)})
    return step
