"""The closed-loop allocator of an asynchronous RL stage: a pure policy (no Ray here).

Every window of `runtime.allocator_window` RL steps the run measures a `Window` (busy fraction of
each stage, queue depths, step rate, sampled tokens/s, mean completion length, CPUs of its budget
and of the cluster) and `Allocator.decide` returns a `Decision`: trainer and generator threads,
generator replicas, env workers, and how many CPUs to ask the cluster for. The rules, and why:

1. Threads: hill-climbing on the ladder of thread plans (`balancer.ladder`), confirmed by the
   measured step rate. Which split is fastest depends on the machine (see balancer.py), so busy
   fractions only choose the *direction* of a trial: one rung towards the stage that is busier by
   more than BOTTLENECK_GAP (the other one waits on it), or either way when they are even. No trial
   is made while neither stage is busy EXPLORE_BUSY of the window: the loop then waits on something
   else (env workers, the driver), which more threads for a stage do not speed up, while a thread
   beyond the cores slows every process (on a 2-core EPYC, 1:2 was the slowest split of
   bench/allocator.py in every round, at 0.3-0.75x of 1:1), so a trial would cost a slow window
   for nothing. The trial runs for one window; it becomes the new plan only if its step rate beats
   the current plan's by CONFIRM_GAIN, otherwise the run reverts. A rejected rung is retried after
   RETRY_EVERY windows, an interval that doubles after each failed retry (up to MAX_RETRY_EVERY):
   on flat rates the plan settles instead of oscillating.
2. Re-planning: when the mean completion length or the step rate (on an unchanged plan) drifts
   by more than DRIFT from the window the plan was chosen in, what was measured no longer
   describes the workload (e.g. completions grew longer as the policy learned): every other rung's
   measurements and back-offs are forgotten, and the ladder is explored again from the current plan.
3. Env workers: one more when a worker is busy at least ENV_BUSY_HIGH of the window and the
   generator is busy less than GENERATOR_WAITING (generation waits on rewards, not on compute);
   one fewer when the remaining workers would still be busy less than ENV_BUSY_LOW. The gap between
   the two thresholds is the hysteresis that keeps the count from flapping. An env change takes the
   window instead of a thread trial, so each step rate measures one change.
4. CPUs: when a stage is busy at least SATURATED and no rung moves threads towards it (it already
   has the most, or both stages are saturated), the budget is what bounds the run: if the cluster
   has CPUs beyond the run's budget, ask for REQUEST_FRACTION of the budget more (Ray's
   `request_resources`, a persistent target). The request is withdrawn (0) after GIVE_BACK_WINDOWS
   windows without that need, e.g. when the stages go idle.

5. Generator replicas (rollout.replicas = "auto"; a number is kept as written): the replica count
   is a second axis of the same hill-climb. A setting is (thread rung, replicas); towards the
   generator, the neighbours are one rung down and one replica more, towards the trainer one rung
   up and one replica fewer, and a trial is kept only on a measured CONFIRM_GAIN. The generator
   side's threads are shared out over its replicas, so a replica more adds no thread: it splits the
   fleet's batch over processes, which pays where a decode step is bound by per-op dispatch, not by
   FLOPs (the built-in model on a CPU), and costs a model copy of memory. A replica lost for good
   lowers the range by one: the run degrades to what is left, it does not replace a crash-looping
   actor.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from lockstep.runtime.balancer import Plan, ladder

Setting = tuple[int, int]
"""(rung of the thread ladder, generator replicas)."""

BOTTLENECK_GAP = 0.15
"""A stage is the bottleneck when its busy fraction exceeds the other's by this much; below it the
difference is within what one window's scheduling noise moves on a 2-core box."""

EXPLORE_BUSY = 0.5
"""A stage busy less than half the window is not what the loop waits on most: no thread trial for it."""

CONFIRM_GAIN = 0.05
"""A trial plan is kept only if its step rate beats the current plan's by 5%: windows of ~25 steps
on a shared 2-core box vary by a few percent, and a smaller edge is not worth a switch."""

SCORE_WINDOWS = 3
"""A plan's score is the median step rate of its last this many windows (one outlier is ignored)."""

RETRY_EVERY = 6
"""Windows before a rejected rung is tried again (the rate drifts as the policy improves)."""

MAX_RETRY_EVERY = 48
"""The retry interval doubles after each failed retry up to this: a flat machine is rarely disturbed."""

DRIFT = 0.25
"""Relative change of completion length or step rate (same plan) that invalidates the measurements."""

ENV_BUSY_HIGH, ENV_BUSY_LOW = 0.7, 0.3
"""An env worker busy 70% of the window delays the episodes queued behind it; below 30% after
removing one, the others absorb its work with room to spare."""

GENERATOR_WAITING = 0.6
"""A generator busy less than this is waiting on something: with env workers busy, on rewards."""

SATURATED = 0.9
"""A stage busy 90% of the window has no slack left to give the loop."""

REQUEST_FRACTION = 0.5
"""Extra CPUs asked of the cluster, as a fraction of the budget (at least one): enough to relieve
one stage, small enough that a busy cluster can grant it."""

GIVE_BACK_WINDOWS = 2
"""Windows without a need for more CPUs before a request is withdrawn (one may be noise)."""


class Reason:
    """alloc/reason: why the decision differs from the last plan (metrics values are numbers)."""

    HOLD = 0
    EXPLORE = 1
    ACCEPT = 2
    REVERT = 3
    RETRY = 4
    REPLAN = 5
    ENV_ADD = 6
    ENV_RETIRE = 7
    REPLICA_LOST = 8


@dataclass(frozen=True)
class Window:
    """What one window of RL steps measured."""

    steps_per_s: float
    sampled_tokens_per_s: float
    completion_tokens: float
    """Mean sampled completion length of the window's trained samples."""
    trainer_busy: float
    """Busy fraction of the window's wall time (0..1)."""
    generator_busy: float
    """Per live replica, mean."""
    env_busy: float
    """Per env worker, mean: seconds in env calls (episodes.run_episodes), which include waiting for
    the worker's event loop while its other rollouts run, i.e. how loaded the worker is."""
    in_flight_batches: float
    """Mean over the window's steps."""
    buffered_groups: float
    budget_cpus: int
    """CPUs of the run's budget (runtime.cpus or the machine)."""
    cluster_cpus: int
    """Total CPUs the Ray cluster reports."""
    generator_replicas: int = 1


@dataclass(frozen=True)
class Decision:
    trainer_threads: int
    generator_threads: int
    """For the whole generator fleet; shared out over its live replicas."""
    generator_replicas: int
    env_workers: int
    request_cpus: int
    """Total CPUs to ask the cluster for (request_resources); 0: no request (or give it back)."""
    reason: int

    @property
    def plan(self) -> Plan:
        return self.trainer_threads, self.generator_threads

    def metrics(self) -> dict[str, float]:
        return {"alloc/trainer_threads": self.trainer_threads, "alloc/generator_threads": self.generator_threads,
                "alloc/generator_replicas": self.generator_replicas,
                "alloc/generator_threads_per_replica": max(1, self.generator_threads // self.generator_replicas),
                "alloc/env_workers": self.env_workers, "alloc/requested_cpus": self.request_cpus,
                "alloc/reason": self.reason}


class Allocator:
    """The policy's state between windows (see the module docstring for the rules)."""

    def __init__(self, cpus: int, *, env_workers: int = 1, max_env_workers: int = 1, generator_replicas: int = 1,
                 max_generator_replicas: int | None = None):
        """`max_generator_replicas` above `generator_replicas` lets it resize the fleet (rollout.replicas
        = "auto"); left out, the fleet keeps its size."""
        self.ladder = ladder(cpus)
        even = self.ladder.index(max(self.ladder, key=lambda p: -abs(p[0] - p[1])))
        self.home: Setting = (even, generator_replicas)
        self.trial: Setting | None = None
        resizable = (max_generator_replicas or 0) > generator_replicas
        self.replica_range = (1, max_generator_replicas) if resizable else (generator_replicas, generator_replicas)
        self.rates: dict[Setting, list[float]] = {}
        self.last_tried: dict[Setting, int] = {}
        self.retry_every: dict[Setting, int] = {}
        self.anchor: Window | None = None
        self.env_workers, self.max_env_workers = env_workers, max(env_workers, max_env_workers)
        self.request, self.unneeded = 0, 0
        self.windows = 0

    @property
    def setting(self) -> Setting:
        return self.home if self.trial is None else self.trial

    @property
    def current(self) -> Plan:
        return self.ladder[self.setting[0]]

    @property
    def replicas(self) -> int:
        return self.setting[1]

    def decide(self, w: Window) -> Decision:
        """Record the window under the setting it ran; the decision for the next window."""
        self.windows += 1
        if self._replicas_lost(w):
            reason = Reason.REPLICA_LOST
        else:
            self.rates.setdefault(self.setting, []).append(w.steps_per_s)
            reason = self._conclude_trial(w) if self.trial is not None else self._on_home(w)
        self.request = self._request(w)
        return Decision(*self.current, self.replicas, self.env_workers, self.request, reason)

    def _replicas_lost(self, w: Window) -> bool:
        """Fewer replicas live than the setting has (out of restarts, or one that never started):
        the range shrinks by as many, home takes the count left, a trial ends unjudged, and what
        was measured with more replicas than the range allows is forgotten."""
        lost = self.replicas - w.generator_replicas
        if lost <= 0:
            return False
        lo, hi = self.replica_range
        self.replica_range = (max(1, lo - lost), max(1, hi - lost))
        self.home, self.trial = (self.home[0], max(1, min(w.generator_replicas, self.replica_range[1]))), None
        self.rates = {k: v for k, v in self.rates.items() if k[1] <= self.replica_range[1]}
        return True

    # -- threads and replicas ----------------------------------------------------------------
    def _score(self, setting: Setting) -> float:
        return median(self.rates[setting][-SCORE_WINDOWS:])

    def _conclude_trial(self, w: Window) -> int:
        """A trial window is over: keep the trial setting if it is faster, else go back."""
        trial, self.trial = self.trial, None
        if self._score(trial) > self._score(self.home) * (1 + CONFIRM_GAIN):
            self.home, self.anchor = trial, w
            self.retry_every.pop(trial, None)
            return Reason.ACCEPT
        self.retry_every[trial] = min(MAX_RETRY_EVERY, 2 * self.retry_every.get(trial, RETRY_EVERY // 2))
        return Reason.REVERT

    def _on_home(self, w: Window) -> int:
        """A window on the current setting: re-plan on drift, change env workers, or try a neighbour."""
        replan = self.anchor is not None and self._drifted(self.anchor, w)
        if replan:
            self.rates = {self.home: self.rates[self.home][-1:]}
            self.last_tried, self.retry_every = {}, {}
        if self.anchor is None or replan:
            self.anchor = w
        env = self._env_change(w)
        if env is not None:
            return env
        setting, why = self._next_trial(w)
        if setting is not None:
            self.trial, self.last_tried[setting] = setting, self.windows
        return Reason.REPLAN if replan else why

    @staticmethod
    def _drifted(anchor: Window, w: Window) -> bool:
        def moved(a: float, b: float) -> bool:
            return a > 0 and abs(b / a - 1) > DRIFT
        return moved(anchor.completion_tokens, w.completion_tokens) or moved(anchor.steps_per_s, w.steps_per_s)

    def _direction(self, w: Window) -> int:
        """+1 towards the trainer, -1 towards the generator, 0 when neither waits on the other."""
        gap = w.trainer_busy - w.generator_busy
        return 1 if gap > BOTTLENECK_GAP else -1 if gap < -BOTTLENECK_GAP else 0

    def _neighbours(self, d: int) -> list[Setting]:
        """Settings one move from home towards the trainer (d = +1: a rung up, a replica fewer),
        the generator (d = -1: a rung down, a replica more), or either way (d = 0); threads first."""
        rung, n = self.home
        lo, hi = self.replica_range
        moves = [(d, 0), (0, -d)] if d else [(-1, 0), (1, 0), (0, 1), (0, -1)]
        out = [(rung + dr, n + dn) for dr, dn in moves]
        return [s for s in out if 0 <= s[0] < len(self.ladder) and lo <= s[1] <= hi]

    def _next_trial(self, w: Window) -> tuple[Setting | None, int]:
        """The neighbouring setting to try next (towards the bottleneck; any when the stages are
        even): an untried one, or a rejected one whose back-off has passed; None to hold."""
        if max(w.trainer_busy, w.generator_busy) < EXPLORE_BUSY:
            return None, Reason.HOLD
        near = self._neighbours(self._direction(w))
        for s in near:
            if not self.rates.get(s):
                return s, Reason.EXPLORE
        for s in near:
            if self.windows - self.last_tried.get(s, 0) >= self.retry_every.get(s, RETRY_EVERY):
                return s, Reason.RETRY
        return None, Reason.HOLD

    # -- env workers and CPUs ----------------------------------------------------------------
    def _env_change(self, w: Window) -> int | None:
        n = self.env_workers
        if w.env_busy >= ENV_BUSY_HIGH and w.generator_busy < GENERATOR_WAITING and n < self.max_env_workers:
            self.env_workers = n + 1
            return Reason.ENV_ADD
        if n > 1 and w.env_busy * n / (n - 1) < ENV_BUSY_LOW:
            self.env_workers = n - 1
            return Reason.ENV_RETIRE
        return None

    def _request(self, w: Window) -> int:
        """The CPUs to ask the cluster for: budget + extra while a saturated stage cannot be given
        more threads and the cluster has CPUs beyond the budget; 0 once that need has passed."""
        d = self._direction(w)
        rung = self.home[0]
        stuck = (w.trainer_busy >= SATURATED and w.generator_busy >= SATURATED) or (
            d != 0 and max(w.trainer_busy, w.generator_busy) >= SATURATED and not 0 <= rung + d < len(self.ladder))
        spare = w.cluster_cpus - w.budget_cpus
        if stuck and spare > 0:
            self.unneeded = 0
            return w.budget_cpus + min(spare, max(1, round(REQUEST_FRACTION * w.budget_cpus)))
        self.unneeded += 1
        return 0 if self.unneeded >= GIVE_BACK_WINDOWS else self.request
