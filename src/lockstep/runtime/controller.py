"""The controller: wires Ray actors into the Generate -> Reward -> Train -> Update loop.

            prompts (RLDataset batches of EnvGroupBuilders; replays first)
                 |
                 v
   +----------------------+  sample(requests), once per turn   +----------------------+
   | GeneratorActor xN    |<-----------------------------------| EnvWorker pool       |
   | (fleet.py: a group   |----------------------------------->| episodes: env turns, |
   | stays on 1 replica)  |  tokens + exact logprobs + version | rewards (retried)    |
   +----------^-----------+                                    +----------+-----------+
              | weights v+1 (object store, zero-copy),                    | rollout groups
              | rolled out one replica at a time                          v
   +----------+-----------+              +-----------------------------------------+
   | publish (version)    |              | ledger (issued -> generated -> rewarded  |
   +----------^-----------+              | -> trained | filtered) + clean(): stale, |
              |                          | zero-variance refill, truncation, repeats|
   +----------+-----------+              +--------------------+--------------------+
   | TrainerActor         |<---- datums (advantages, sampler logprobs, loss) -------+
   +----------------------+

Contract of the RL loop: it keeps up to `max_staleness + 1` rollout batches in flight (so with 0
it is synchronous on-policy), consumes finished batches in order, waits only on the oldest, and
trains whenever `prompts_per_step` clean groups are buffered. Every remote call has a deadline.
Losing a generator replica or env worker costs only its work: a batch lost with it is replayed
once Ray has restarted it, and a restarted replica is given the last published weights (whichever
call noticed the loss: a rollout, a weight update, an evaluation, a stats read); a replica out of
restarts is dropped and the run goes on with the others. A crashed trainer raises TrainerLost,
and the run resumes from its last checkpoint.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import ray

from lockstep.config.types import StageSpec
from lockstep.monitor.trace import Timed
from lockstep.runtime.calls import ComponentDead, ComponentError, is_component_loss, wait
from lockstep.runtime.filters import FilterReport, clean, to_datums, too_stale
from lockstep.runtime import forwards
from lockstep.runtime.fleet import GeneratorFleet, replica_name
from lockstep.runtime.ledger import Ledger
from lockstep.runtime.types import MAX_REFILL_BATCHES, RolloutGroup, RolloutRequest

log = logging.getLogger("lockstep.run")


class TrainerLost(RuntimeError):
    """The trainer crashed and Ray restarted it: its state since the last checkpoint is gone."""


@dataclass
class Components:
    trainer: "ray.actor.ActorHandle"
    fleet: GeneratorFleet
    envs: list
    timeout: float
    version: int = 0
    lineage: str | None = None
    """The trainer's branch of the published weights (TrainerActor.publish): with `version`, what
    names them (a rollback publishes the same versions again on a new branch)."""
    weights_ref: object = None
    threads: tuple[int, int] = (1, 1)
    """(trainer, generator fleet) torch threads, re-applied to a restarted actor; the fleet's
    threads are shared out over its live replicas."""
    incarnations: dict = field(default_factory=dict)
    nodes: dict = field(default_factory=dict)
    """Per actor, the id of the Ray node it runs on (as last seen)."""
    env_turn: int = 0
    stats: dict = field(default_factory=lambda: collections.defaultdict(float))
    busy_before: dict = field(default_factory=dict)
    """Per actor, busy seconds of its earlier incarnations (as last read), so busy fractions
    survive a restart."""
    last_stats: dict = field(default_factory=dict)
    spans: object = None
    """The run's SpanLog (monitor/trace.py), or None: where the loop's spans go."""
    starting: list = field(default_factory=list)
    """Env workers the allocator started: (actor, ref of its first stats()), routed to once ready."""
    retiring: list = field(default_factory=list)
    """Env workers the allocator retired: (actor, ref of its drain()), stopped once drained."""
    requested_cpus: int = 0
    """The CPUs last asked of the cluster through request_resources (0: none)."""
    starting_generators: list = field(default_factory=list)
    """Generator replicas the allocator started: (index, actor, ref of its first stats(), start
    time), added to the fleet once ready and given the newest weights."""
    allow_mixed_forward: bool = False
    """runtime.allow_mixed_forward: take part even when a component's forward differs from the
    trainer's (runtime/forwards.py)."""
    forwards: dict = field(default_factory=dict)
    """Per component that runs the model (trainer ranks, generator replicas), the ForwardFingerprint
    it reported."""

    def actors(self) -> dict:
        return {"trainer": self.trainer, **self.fleet.live(), **{f"env{i}": e for i, e in enumerate(self.envs)}}

    def every_actor(self) -> list:
        """Every actor of the run, also those starting, retiring or draining (what to stop at its end)."""
        return [self.trainer, *self.fleet.actors(), *self.envs, *(a for a, _ in self.starting + self.retiring),
                *(a for _, a, *_ in self.starting_generators)]

    def publish(self, *, background: bool = False) -> None:
        """Put the trainer's weights in the object store and hand them to the generator fleet:
        with `background` (an asynchronous stage) rolled out replica by replica while the loop
        goes on; otherwise parked on every replica before this returns."""
        with Timed(self.spans, "publish", "weights") as span:
            version_ref, lineage_ref, weights_ref = self.trainer.publish.remote()
            self.version, self.lineage = wait([version_ref, lineage_ref], self.timeout, "trainer.publish")
            self.weights_ref = weights_ref
            # Parking the weights is instant; waiting for it orders it before the next sample call
            # (the weights group runs beside sampling), which keeps max_staleness=0 truly on-policy.
            self._tell_fleet(lambda: self.fleet.publish(self.version, self.lineage, weights_ref,
                                                        background=background))
            span.args["version"] = self.version
        if self.fleet.stalls:  # rollout.weight_sync = "pause": how long each held the whole fleet
            self.stats["weights/fleet_pauses"] = len(self.fleet.stalls)
            self.stats["weights/fleet_pause_s_max"] = max(self.fleet.stalls)

    def settle(self) -> None:
        """Every live replica on the newest published weights (a rolling update finished)."""
        self._tell_fleet(self.fleet.settle)

    def replica_threads(self) -> int:
        return max(1, self.threads[1] // max(1, len(self.fleet.router.live)))

    def set_threads(self, trainer: int, generator: int) -> None:
        self.threads = (trainer, generator)
        wait(self.trainer.set_threads.remote(trainer), self.timeout, "trainer.set_threads")
        n = self.replica_threads()
        self._tell_fleet(lambda: wait([g.set_threads.remote(n) for g in self.fleet.live().values()], self.timeout,
                                      "generator.set_threads"))

    def _tell_fleet(self, call) -> None:
        """Hand the fleet a setting (weights, threads) already recorded here. If a replica died,
        recover() gives its new incarnation every recorded setting, which is all the call was for."""
        try:
            call()
        except ComponentError as e:
            if not is_component_loss(e):
                raise
            self.recover()

    # -- what the allocator changes (runtime/allocator.py) -----------------------------------
    def start_env(self, actor) -> None:
        """A new env worker, routed to once it has started (poll_envs): waiting for its start-up
        (imports, the tokenizer) here would stall the loop."""
        self.starting.append((actor, actor.stats.remote()))

    def poll_envs(self, *, block: bool = False) -> None:
        """Route to the env workers that have started, as the next "env<i>" (their incarnation
        noted, so recover() does not count their start as a restart); stop the retired ones that
        have drained. With `block`, wait for every one of them."""
        for actor, ref in list(self.starting):
            if ray.wait([ref], timeout=self.timeout if block else 0)[0]:
                self.starting.remove((actor, ref))
                name = f"env{len(self.envs)}"
                s = wait(ref, self.timeout, f"{name}.stats")
                self._forget(name)
                self.envs.append(actor)
                self.incarnations[name], self.nodes[name] = s["incarnation"], s["node"]
        self.reap_retired(block=block)

    def retire_env(self) -> None:
        """Send the last env worker no new rollout; it is stopped once its rollouts in flight have
        returned (reap_retired), so the loop collects them as usual and nothing is lost."""
        assert len(self.envs) > 1, "the last env worker is never retired"
        actor = self.envs.pop()
        self._forget(f"env{len(self.envs)}")
        self.retiring.append((actor, actor.drain.remote()))

    def reap_retired(self, *, block: bool = False) -> int:
        """Stop the retired env workers that have drained (with `block`, wait for all of them);
        returns how many are still draining. A retiree that died has nothing left to drain."""
        for actor, ref in list(self.retiring):
            ready, _ = ray.wait([ref], timeout=self.timeout if block else 0)
            if ready or block:
                ray.kill(actor)
                self.retiring.remove((actor, ref))
        return len(self.retiring)

    def start_generator(self, index: int, actor) -> None:
        """A new generator replica, routed to once it has started and holds the newest weights
        (poll_generators); its start-up (a process, the model) is not waited for here."""
        self.starting_generators.append((index, actor, actor.stats.remote(), time.time()))

    def poll_generators(self, *, block: bool = False) -> int:
        """Add the replicas that have started to the fleet: the fleet's threads are shared out
        again, and each is given the newest published weights before any group is routed to it.
        Stop the retired replicas whose groups are back. How many joined."""
        joined = 0
        for entry in list(self.starting_generators):
            index, actor, ref, since = entry
            if not ray.wait([ref], timeout=max(0.0, since + self.timeout - time.time()) if block else 0)[0]:
                if time.time() > since + self.timeout:  # e.g. no node can hold it: the fleet stays as it is
                    self.starting_generators.remove(entry)
                    ray.kill(actor)
                    self.stats["alloc/generator_start_failures"] += 1
                    log.warning("a new generator replica did not start within %.0fs: going on without it", self.timeout)
                continue
            self.starting_generators.remove(entry)
            try:
                s = wait(ref, self.timeout, "generator.stats")
                admitted = not self.compare_forwards({replica_name(index): s})
                if admitted and self.weights_ref is not None:
                    wait(actor.set_weights.remote(self.version, self.weights_ref, time.time(), self.lineage), self.timeout,
                         "generator.set_weights")
            except ComponentError as e:  # it failed to start (its error is in the message)
                ray.kill(actor)
                self.stats["alloc/generator_start_failures"] += 1
                log.warning("a new generator replica failed to start: %s", e)
                continue
            if not admitted:
                ray.kill(actor)
                continue
            name = self.fleet.add(index, actor)
            self.incarnations[name], self.nodes[name] = s["incarnation"], s["node"]
            joined += 1
        if joined:
            self.set_threads(*self.threads)
        self.stats["alloc/generator_replicas_stopped"] += self.fleet.reap(ray.kill)
        return joined

    def retire_generator(self) -> None:
        """Route no new group to the newest live replica; it is stopped once its groups are back."""
        name = self.fleet.retire()
        self._forget(name)
        self.set_threads(*self.threads)

    def _forget(self, name: str) -> None:
        for d in (self.incarnations, self.nodes, self.last_stats, self.busy_before, self.forwards):
            d.pop(name, None)

    # -- every component computes the trainer's bits (runtime/forwards.py) -------------------
    def compare_forwards(self, stats: dict, *, start: bool = False) -> list[str]:
        """Note the fingerprints in `stats` (actor name -> its stats()) and compare every
        component's with the trainer's. At start a difference refuses the run (MixedForward).
        Later, the generator replicas that differ are returned, to be kept out (forgotten here,
        logged, counted) while other replicas are left; a trainer rank that differs, or no replica
        left, refuses the run. With runtime.allow_mixed_forward all take part, differences logged."""
        new = forwards.reported(stats)
        self.forwards = {**({} if start else self.forwards), **new}
        diffs = forwards.differing(self.forwards)
        if not diffs or self.allow_mixed_forward:
            # components taking part with another forward (all of them again if the trainer is new)
            self.stats["runtime/mixed_forward"] += len(diffs) if forwards.REFERENCE in new else len(diffs.keys() & new)
            if diffs:
                log.warning("runtime.allow_mixed_forward = true, running with: %s. The mismatch panel (metrics "
                            "mismatch/*) measures what it costs", forwards.describe(diffs))
            return []
        out = [name for name in diffs if not name.startswith(forwards.REFERENCE)]
        if start or len(out) < len(diffs) or not set(self.fleet.live()) - set(out):
            raise forwards.refusal(diffs)
        for name in out:
            self._forget(name)
            self.stats["runtime/forward_refused"] += 1
            log.warning("%s is kept out of the run: %s. To use it: %s", name, forwards.describe({name: diffs[name]}),
                        forwards.FIX)
        return out

    def request_cpus(self, num_cpus: int) -> None:
        """Ask the Ray autoscaler for a cluster of at least `num_cpus` CPUs (0 withdraws the
        request). Ray keeps the last request until the next one, so it is sent only on a change."""
        from ray.autoscaler.sdk import request_resources

        if num_cpus != self.requested_cpus:
            request_resources(num_cpus=num_cpus)
            self.requested_cpus = num_cpus

    def rollout(self, request: RolloutRequest):
        env = self.envs[self.env_turn % len(self.envs)]
        self.env_turn += 1
        return env.rollout.remote(request)

    def stat(self, name: str) -> dict:
        """An actor's stats, its busy seconds counted over every incarnation."""
        s = self.call(lambda: self.actors()[name].stats.remote(), f"{name}.stats")
        last = self.last_stats.get(name)
        if last is not None and last["incarnation"] != s["incarnation"]:
            self.busy_before[name] = self.busy_before.get(name, 0.0) + last["busy_s"]
        self.last_stats[name] = s
        return {**s, "busy_s": s["busy_s"] + self.busy_before.get(name, 0.0)}

    def generator_stat(self) -> dict:
        """The fleet's stats: busy seconds per replica (mean), the oldest version any live replica
        holds, the worst swap latency and stall, speculative counters summed over replicas."""
        per = [self.stat(name) for name in list(self.fleet.live())]
        spec: dict = {}
        for s in per:
            for k, v in s["speculative"].items():
                spec[k] = min(spec.get(k, v), v) if k in ("draft_version", "draft_data_version") else spec.get(k, 0) + v
        if "draft_loss" in spec:
            spec["draft_loss"] /= len(per)
        return {"version": min(s["version"] for s in per), "busy_s": sum(s["busy_s"] for s in per) / len(per),
                "swap_latency_s_max": max(s["swap_latency_s_max"] for s in per),
                "stall_s_max": max(s["stall_s_max"] for s in per), "stalls": sum(s["stalls"] for s in per),
                "replicas": len(per), "requests": [s["requests"] for s in per], "speculative": spec}

    def ping(self, name: str) -> dict:
        """stats() of an actor, waiting while Ray restarts it; out of restarts is an error."""
        deadline = time.time() + self.timeout
        while True:
            try:
                return ray.get(self.actors()[name].stats.remote(), timeout=max(1.0, deadline - time.time()))
            except ray.exceptions.ActorUnavailableError:
                if time.time() > deadline:
                    raise ComponentError(f"{name} did not come back within {self.timeout:.0f}s") from None
                time.sleep(0.5)
            except ray.exceptions.ActorDiedError as e:
                raise ComponentDead(f"{name} died and is out of restarts (runtime.max_restarts)") from e
            except ray.exceptions.GetTimeoutError:
                raise ComponentError(f"{name}.stats did not answer within {self.timeout:.0f}s") from None

    def note_incarnations(self) -> None:
        stats = {name: wait(a.stats.remote(), self.timeout, f"{name}.stats") for name, a in self.actors().items()}
        self.incarnations = {name: s["incarnation"] for name, s in stats.items()}
        self.nodes = {name: s["node"] for name, s in stats.items()}
        self.compare_forwards(stats, start=True)

    def recover(self) -> None:
        """After a component loss: wait until Ray has restarted every actor, give a restarted
        generator replica the last published weights, and raise TrainerLost if the trainer
        restarted. A generator replica out of restarts is dropped while others are left (the
        run degrades to them, with a warning); any other actor out of restarts raises."""
        self._settle_quietly()
        now, nodes, seen = {}, {}, {}
        for name in list(self.actors()):
            try:
                s = seen[name] = self.ping(name)
                now[name], nodes[name] = s["incarnation"], s["node"]
            except ComponentDead:
                if name not in self.fleet.names or len(self.fleet.router.live) == 1:
                    raise
                self.fleet.router.drop(self.fleet.index(name))
                self.forwards.pop(name, None)
                self.stats["runtime/generators_lost"] += 1
                log.warning("%s is out of restarts: going on with %d generator replica(s)", name,
                            len(self.fleet.router.live))
        restarted = [name for name in now if now[name] != self.incarnations.get(name)]
        self.stats["runtime/restarts"] += len(restarted)
        moved = [name for name in restarted if self.nodes.get(name, nodes[name]) != nodes[name]]
        if moved:  # their node was lost: the run goes on with the capacity left
            self.stats["runtime/actors_moved"] += len(moved)
            log.warning("%s restarted on another node (node %s lost?): the run goes on with the nodes left",
                        ", ".join(moved), ", ".join(sorted({self.nodes[n][:12] for n in moved})))
        self.incarnations, self.nodes = now, nodes
        for name in self.compare_forwards({name: seen[name] for name in restarted}):  # it may run elsewhere now
            actor = self.actors()[name]
            self.fleet.router.drop(self.fleet.index(name))
            ray.kill(actor)
        if "trainer" in restarted:
            raise TrainerLost("the trainer actor was restarted")
        for name in restarted:
            if name in self.fleet.live():  # not dropped above
                g = self.actors()[name]
                wait(g.set_threads.remote(self.replica_threads()), self.timeout, f"{name}.set_threads")
                if self.weights_ref is not None:
                    wait(g.set_weights.remote(self.version, self.weights_ref, time.time(), self.lineage), self.timeout,
                         f"{name}.set_weights")

    def _settle_quietly(self) -> None:
        """Let a rolling update end before recovering; a replica it lost is what recover() is for."""
        try:
            self.fleet.settle()
        except ComponentError as e:
            if not is_component_loss(e):
                raise

    def call(self, make_ref, what: str):
        """An idempotent call (evaluation, stats): retried once after recovering a lost component."""
        try:
            return wait(make_ref(), self.timeout, what)
        except ComponentError as e:
            if not is_component_loss(e):
                raise
            self.recover()
            return wait(make_ref(), self.timeout, what)


def adam(stage: StageSpec) -> dict:
    return {"learning_rate": stage.learning_rate, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "grad_clip_norm": 1.0}


def staleness_histogram(batch, trainer_version: int, max_staleness: int) -> dict[str, float]:
    """Samples per staleness (trainer version minus the sample's oldest token version), the max, and
    (asynchronous stages) the share of samples at the bound: near 1, the generator is always a full
    `max_staleness` behind, i.e. the bound, not the work, sets the pace."""
    ages = [trainer_version - s.version for g in batch for s in g.samples]
    hist = {f"staleness/{a}": ages.count(a) for a in sorted(set(ages))}
    out = {**hist, "rollout/staleness_max": max(ages)}
    if max_staleness > 0:
        out["rollout/staleness_at_bound"] = sum(a >= max_staleness for a in ages) / len(ages)
    return out


class RLLoop:
    """The state of one RL stage: in-flight batches, the buffer, the data cursor and the ledger.

    Its position (`position()`) goes into every checkpoint; groups in flight or buffered at that
    moment are pending in the ledger's snapshot and are replayed on resume.
    """

    def __init__(self, c: Components, stage: StageSpec, index: int, dataset, ledger: Ledger, *,
                 seed: int, position: dict | None = None, fork: tuple[int, int] = (0, 1)):
        self.c, self.stage, self.index, self.dataset, self.ledger, self.seed = c, stage, index, dataset, ledger, seed
        self.fork = fork
        """(turn, branches) of episode forking (rollout.fork)."""
        pos = position or {}
        self.step, self.next_batch, self.next_index = pos.get("step", 0), pos.get("next_batch", 0), pos.get("next_index", 0)
        self.in_flight: collections.deque = collections.deque()
        self.buffer: list[RolloutGroup] = []
        self.spare: list[RolloutGroup] = []
        self.refills = 0
        self._batches: dict[int, list] = {}
        c.fleet.router.reset()  # a rollback abandons the batches an earlier loop had in flight

    def position(self) -> dict:
        return {"step": self.step, "next_batch": self.next_batch, "next_index": self.next_index}

    # -- Generate ----------------------------------------------------------------------------
    def builder(self, gid: str):
        stage, batch, i = (int(x) for x in gid.split("."))
        assert stage == self.index, gid
        if batch not in self._batches:
            self._batches = {k: v for k, v in self._batches.items() if k >= batch - 8}
            self._batches[batch] = list(self.dataset.get_batch(batch))
        return self._batches[batch][i]

    def _next_ids(self, count: int) -> list[str]:
        ids = [g for g in self.ledger.replay if g.startswith(f"{self.index}.")][:count]
        while len(ids) < count:
            ids.append(f"{self.index}.{self.next_batch}.{self.next_index}")
            self.next_index += 1
            if self.next_index == self.stage.prompts_per_step:
                self.next_batch, self.next_index = self.next_batch + 1, 0
        return ids

    def fill(self) -> None:
        """Keep max_staleness + 1 rollout batches in flight."""
        s = self.stage
        while len(self.in_flight) < s.max_staleness + 1:
            ids = self._next_ids(s.prompts_per_step)
            self.ledger.issue(ids)
            req = RolloutRequest(tuple(ids), tuple(self.builder(g) for g in ids), s.group_size, s.temperature,
                                 self.seed, *self.fork, routes=self.c.fleet.router.assign(len(ids)))
            self.in_flight.append((self.c.rollout(req), req, time.time()))

    # -- Reward ------------------------------------------------------------------------------
    def collect(self) -> FilterReport | None:
        """Wait for the oldest batch, record it in the ledger and clean it; None if a crashed
        component lost it (its groups are queued for replay)."""
        ref, req, issued = self.in_flight.popleft()
        t = time.perf_counter()
        try:
            groups = wait(ref, self.c.timeout, "rollout (generate + reward)")
        except ComponentError as e:
            if not is_component_loss(e):
                raise
            self.ledger.requeue(list(req.group_ids), "component_restart")
            self.c.recover()
            return None
        finally:
            self.c.fleet.router.release(req.routes)
        self.c.stats["wait_s"] += time.perf_counter() - t
        self.c.stats["tokens/sampled"] += sum(sum(x.sampled) if x.sampled else len(x.tokens) for g in groups for x in g.samples)
        ids = [g.group_id for g in groups]
        self._spans(groups, issued)
        self.ledger.generated(ids, max(g.generated_at for g in groups))
        self.ledger.rewarded(ids, max(g.rewarded_at for g in groups))
        s = self.stage
        report = clean(groups, trainer_version=self.c.version, max_staleness=s.max_staleness,
                       truncation=s.truncation, truncated_reward=s.truncated_reward)
        self._retire([g.group_id for g in report.failed], "env_failed")
        self._stale([g.group_id for g in report.stale])
        self.buffer.extend(report.kept)
        self.spare.extend(report.no_signal)
        for k, v in report.counts().items():
            self.c.stats[k] += v
        return report

    def _spans(self, groups, issued: float) -> None:
        """The batch's generation (issued -> its last group generated) and rewards (its first group
        generated -> its last rewarded), as spans of the generator and the environments."""
        log = self.c.spans
        if log is None or not groups:
            return
        first_id = groups[0].group_id.rsplit(".", 1)[0]
        generated = max(g.generated_at for g in groups)
        log.span("generate", "generator", issued, generated, batch=first_id, groups=len(groups),
                 samples=sum(len(g.samples) for g in groups))
        log.span("reward", "environments", min(g.generated_at for g in groups), max(g.rewarded_at for g in groups),
                 batch=first_id, groups=len(groups))

    def _retire(self, ids: list[str], reason: str) -> None:
        if ids:
            self.ledger.filtered(ids, reason)

    def _stale(self, ids: list[str]) -> None:
        if not ids:
            return
        if self.stage.stale_policy == "regenerate":
            self.ledger.requeue(ids, "stale")
            self.c.stats["filter/stale_regenerated"] += len(ids)
        else:
            self.ledger.filtered(ids, "stale")

    def batch_ready(self) -> list[RolloutGroup] | None:
        """Dynamic sampling: a full batch once enough groups with signal are buffered, or after
        MAX_REFILL_BATCHES, completed with zero-variance groups."""
        p = self.stage.prompts_per_step
        self.refills += 1
        if len(self.buffer) < p and self.refills < MAX_REFILL_BATCHES:
            return None
        if len(self.buffer) < p:
            need = p - len(self.buffer)
            self.c.stats["filter/underfilled_steps"] += 1
            self.buffer, self.spare = self.buffer + self.spare[:need], self.spare[need:]
        if not self.buffer:  # every group failed or went stale: keep drawing, but not forever
            if self.refills >= 8 * MAX_REFILL_BATCHES:
                raise ComponentError(f"no trainable group in {self.refills} rollout batches (see env/failed_groups "
                                     "and filter/stale in metrics.jsonl, and envs.log for the envs' tracebacks)")
            return None
        batch, self.buffer = self.buffer[:p], self.buffer[p:]
        self._retire([g.group_id for g in self.spare], "zero_variance")
        self.refills, self.spare = 0, []
        fresh = [g for g in self.buffer if not too_stale(g, self.c.version + 1, self.stage.max_staleness)]
        kept = {g.group_id for g in fresh}
        self._stale([g.group_id for g in self.buffer if g.group_id not in kept])  # leftovers too old next step
        self.buffer = fresh
        return batch

    # -- Train -------------------------------------------------------------------------------
    def train(self, batch: list[RolloutGroup]) -> dict:
        s = self.stage
        data, starts = to_datums(batch, estimator=s.advantage)
        with Timed(self.c.spans, "train", "trainer", step=self.step + 1, groups=len(batch)):
            metrics = wait(self.c.trainer.train.remote(data, s.loss, adam(s), dict(s.loss_config), starts),
                           self.c.timeout, "trainer.train")
        self.step += 1
        self.ledger.trained([g.group_id for g in batch], self.step)
        return metrics

    def pending_ids(self) -> list[str]:
        """This stage's groups issued (or queued) but neither trained nor filtered."""
        return [g for g in self.ledger.pending() if g.startswith(f"{self.index}.")]

    def queues(self) -> dict:
        return {"queue/in_flight_batches": len(self.in_flight), "queue/buffered_groups": len(self.buffer),
                "queue/replay_groups": len(self.ledger.replay)}


def rl_stage(loop: RLLoop, on_step, should_stop) -> int:
    """The RL loop (see the module docstring for its contract). Returns steps taken."""
    c = loop.c
    while loop.step < loop.stage.steps and not should_stop(loop.step):
        loop.fill()                               # Generate (+ Reward, in the env pool)
        report = loop.collect()                   # wait for the oldest batch; ledger; clean
        if report is None:
            continue                              # lost with a crashed component: replayed
        batch = loop.batch_ready()                # dynamic sampling: refill before training
        if batch is None:
            continue
        try:
            metrics = loop.train(batch)           # Train
        except ComponentError as e:
            if is_component_loss(e):
                c.recover()                       # raises TrainerLost: resume from checkpoint
            raise
        c.publish(background=loop.stage.max_staleness > 0)  # Update: rolled out over the generator replicas
        trained_at = c.version - 1                # the version the trainer held during this step
        on_step(loop.step, batch, metrics, {**report.counts(), **loop.queues(),
                                            **staleness_histogram(batch, trained_at, loop.stage.max_staleness)})
    return loop.step
