"""Running episodes: env turns interleaved with batched sampling, for one rollout request.

Every turn, the observations of all live episodes are gathered into one sampling call (episodes
of one group that see the same context share one request, so its prefill is shared), then every
episode steps its env with the sampled action. An episode's tokens after the prompt are one
sequence: sampled tokens carry their exact logprobs and versions, env-inserted tokens are marked
unsampled (no loss on them). Env calls have a deadline and are retried, from a snapshot when the
env can fork; an episode whose env keeps failing is marked failed, and its group is not trained.

Forking (`rollout.fork`): an episode still running after `fork_turn` turns is split into
`fork_branches`: its env is snapshotted and restored into fresh envs of the same problem, and the
branches go on from the same context (one sampling request, so the prefix is prefilled once). The
branches form a family; training gives the shared prefix the family's mean reward against the
group's other families, and each branch's continuation its reward against the family's mean.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Awaitable, Callable, Sequence

from lockstep.envs.types import ForkableEnv, Observation, StepResult
from lockstep.runtime.types import RolloutGroup, RolloutRequest, Sample

log = logging.getLogger("lockstep.envs")


class RateLimitedLog:
    """Logs at most `burst` failures with their traceback per `window_s`, then one line saying how
    many were left out. A broken env fails every call of every episode: a traceback each would
    bury the log (and a service job's uploaded log tail). The logging module has no rate limit."""

    def __init__(self, logger: logging.Logger, burst: int = 5, window_s: float = 60.0):
        self.logger, self.burst, self.window_s = logger, burst, window_s
        self.window_start, self.logged, self.left_out = time.monotonic(), 0, 0

    def exception(self, msg: str, *args) -> None:
        """Call from an `except` block: the active exception's traceback is logged with `msg`."""
        now = time.monotonic()
        if now - self.window_start >= self.window_s:
            if self.left_out:
                self.logger.error("%d more env failures in the last %.0f s were not logged", self.left_out,
                                  now - self.window_start)
            self.window_start, self.logged, self.left_out = now, 0, 0
        if self.logged < self.burst:
            self.logged += 1
            self.logger.error(msg, *args, exc_info=True)
        else:
            self.left_out += 1


env_errors = RateLimitedLog(log)


def request_seed(seed: int, group_id: str, turn: int, index: int) -> int:
    """A sampling seed per (group, turn, request of the group): a group samples the same tokens
    under the same weights whatever batch, replica or replay it comes in (so a replayed batch is
    the batch it replaces), and distinct groups draw distinct streams."""
    digest = hashlib.blake2b(f"{seed}:{group_id}:{turn}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class Episode:
    def __init__(self, env):
        self.env = env
        self.prompt: tuple[int, ...] = ()
        self.obs: Observation | None = None
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.sampled: list[bool] = []
        self.version: int | None = None
        self.reward, self.metrics, self.turns = 0.0, {}, 0
        self.stop_reason, self.done, self.failed = "stop", False, False
        self.family, self.fork_at, self.owns_prefix = -1, 0, True

    def branch(self, env) -> "Episode":
        """A copy of this episode's record, going on in `env` (already restored to its state)."""
        ep = Episode(env)
        for name in ("prompt", "obs", "version", "reward", "turns", "stop_reason", "family", "fork_at"):
            setattr(ep, name, getattr(self, name))
        ep.tokens, ep.logprobs, ep.sampled = list(self.tokens), list(self.logprobs), list(self.sampled)
        ep.metrics, ep.owns_prefix = dict(self.metrics), False
        return ep

    @property
    def live(self) -> bool:
        return not (self.done or self.failed)

    def take(self, seq) -> None:
        """Record a sampled action (an engine SampledSequence)."""
        self.tokens += seq.tokens
        self.logprobs += seq.logprobs
        self.sampled += [True] * len(seq.tokens)
        self.version = seq.policy_version if self.version is None else min(self.version, seq.policy_version)
        self.stop_reason, self.turns = seq.stop_reason, self.turns + 1

    def advance(self, result: StepResult, action: Sequence[int]) -> None:
        self.reward += float(result.reward)
        self.metrics = dict(result.metrics)
        if result.episode_done:
            self.done = True
            return
        nxt = result.next_observation
        context = self.obs.tokens + tuple(action)
        if nxt is None or tuple(nxt.tokens[: len(context)]) != context:
            raise ValueError("a multi-turn env's next observation must extend the previous context and action")
        inserted = nxt.tokens[len(context):]
        self.tokens += inserted
        self.logprobs += [0.0] * len(inserted)
        self.sampled += [False] * len(inserted)
        self.obs = nxt

    def sample(self) -> Sample:
        return Sample(tuple(self.tokens), tuple(self.logprobs), self.version or 0, self.stop_reason, self.reward,
                      self.metrics, () if all(self.sampled) else tuple(self.sampled), self.turns, self.family,
                      self.fork_at, self.owns_prefix)


async def _call(what: str, make_call: Callable[[], Awaitable], env, *, retries: int, timeout_s: float):
    """An env call with a deadline, retried from the env's snapshot when it can fork."""
    snap = env.snapshot() if isinstance(env, ForkableEnv) else None
    for attempt in range(retries + 1):
        try:
            return await asyncio.wait_for(make_call(), timeout_s)
        except asyncio.TimeoutError:
            env_errors.exception("%s.%s took over %.1f s (try %d of %d)", type(env).__name__, what, timeout_s,
                                 attempt + 1, retries + 1)
        except Exception:  # noqa: BLE001 - any env failure is retried, then counted, never fatal
            env_errors.exception("%s.%s raised (try %d of %d)", type(env).__name__, what, attempt + 1, retries + 1)
        if snap is not None:
            env.restore(snap)
    raise _EnvFailed


class _EnvFailed(Exception):
    pass


async def _start(ep: Episode, **kw) -> None:
    try:
        ep.obs = await _call("initial_observation", ep.env.initial_observation, ep.env, **kw)
        ep.prompt = tuple(ep.obs.tokens)
    except _EnvFailed:
        ep.failed = True


async def _step(ep: Episode, action: tuple[int, ...], **kw) -> None:
    try:
        result = await _call("step", lambda: ep.env.step(list(action)), ep.env, **kw)
        ep.advance(result, action)
    except _EnvFailed:
        ep.failed = True
    except ValueError:
        env_errors.exception("%s.step returned an observation the episode cannot take", type(ep.env).__name__)
        ep.failed = True


def _requests(groups: list[list[Episode]], ids, turn: int, base_seed: int, temperature: float):
    """One SampleRequest per distinct observation per group; returns (requests, episodes per
    request, group index per request)."""
    from lockstep.engine.types import SampleRequest, SamplingParams

    requests, owners, group_of = [], [], []
    for g, episodes in enumerate(groups):
        first = len(requests)
        by_obs: dict[tuple, list[Episode]] = {}
        for ep in episodes:
            if ep.live:
                by_obs.setdefault((tuple(ep.obs.tokens), ep.obs.stop, ep.obs.max_tokens), []).append(ep)
        for eps in by_obs.values():
            obs = eps[0].obs
            params = SamplingParams(max_tokens=obs.max_tokens, temperature=temperature, stop=obs.stop,
                                    seed=request_seed(base_seed, ids[g], turn, len(requests) - first))
            requests.append(SampleRequest(tuple(obs.tokens), params, num_samples=len(eps)))
            owners.append(eps)
            group_of.append(g)
    return requests, owners, group_of


def _fork(episodes: list[Episode], builder, tokenizer, branches: int) -> list[Episode]:
    """Branches of every live episode of one group (the originals are the first branch)."""
    out = []
    for index, ep in enumerate(list(episodes)):
        if not ep.live or not isinstance(ep.env, ForkableEnv):
            continue
        try:
            snap = ep.env.snapshot()
            envs = list(builder.make_envs(branches - 1, tokenizer))
            for env in envs:
                env.restore(snap)
        except Exception:  # noqa: BLE001 - an env that cannot fork goes on unforked
            env_errors.exception("%s could not fork an episode", type(ep.env).__name__)
            continue
        ep.family, ep.fork_at = index, len(ep.tokens)
        out += [ep.branch(env) for env in envs]
    return out


async def run_episodes(request: RolloutRequest, tokenizer, sample: Callable, *, retries: int,
                       timeout_s: float) -> tuple[list[RolloutGroup], float]:
    """Roll out every group of `request`; `sample(requests, groups)` is the generator (`groups[i]`:
    the index in `request` of the group request i belongs to). Returns the groups and the seconds
    spent in env calls (not waiting for the generator)."""
    kw = {"retries": retries, "timeout_s": timeout_s}
    groups = [[Episode(env) for env in b.make_envs(request.group_size, tokenizer)] for b in request.builders]
    flat = [ep for g in groups for ep in g]
    fork_turn, branches = request.fork_turn, request.fork_branches
    env_s = time.perf_counter()
    await asyncio.gather(*(_start(ep, **kw) for ep in flat))
    env_s = time.perf_counter() - env_s
    turn, generated_at = 0, time.time()
    while any(ep.live for ep in flat):
        requests, owners, group_of = _requests(groups, request.group_ids, turn, request.seed, request.temperature)
        results = await sample(requests, group_of)
        generated_at = time.time()
        stepping = []
        for eps, result in zip(owners, results):
            for ep, seq in zip(eps, result.sequences):
                ep.take(seq)
                stepping.append(_step(ep, seq.tokens, **kw))
        t = time.perf_counter()
        await asyncio.gather(*stepping)
        turn += 1
        if fork_turn and branches > 1 and turn == fork_turn:
            for episodes, builder in zip(groups, request.builders):
                new = _fork(episodes, builder, tokenizer, branches)
                episodes += new
                flat += new
        env_s += time.perf_counter() - t
    rewarded_at = time.time()
    out = [RolloutGroup(gid, next((ep.prompt for ep in eps if ep.prompt), ()), tuple(ep.sample() for ep in eps), sum(ep.failed for ep in eps),
                        generated_at, rewarded_at)
           for gid, eps in zip(request.group_ids, groups)]
    return out, env_s
