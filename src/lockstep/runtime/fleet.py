"""The generator fleet: N generator replicas behind a router, and how new weights reach them.

Routing. The unit is a prompt group: every turn of every episode of a group goes to one replica
(`RolloutRequest.routes`), so the group's samples share their prompt's prefill and KV cache. The
router gives each new group to the live replica with the fewest groups outstanding (ties: lowest
index), so a batch is spread evenly and a slow replica receives less. The engine's forward is
batch invariant and every request carries its own seed, so which replica samples a group, and
with what else in its batch, changes no token and no logprob: a sync run is bit for bit the same
for any number of replicas.

Weight sync. `publish` hands a new version to every live replica in one of two ways:
- rolling (rollout.weight_sync = "rolling", the default): in the background, one replica at a
  time; each swaps at its next decode step (re-prefilling its rows) while the others go on
  decoding, and the next replica is given the weights once it has. The next publication first
  waits for this one to finish, so replicas are never more than one version apart, and every
  token records the version it was sampled under; the staleness filter (filters.too_stale) checks
  every sample against the trainer's version whatever replica made it.
- pause (rollout.weight_sync = "pause"): what most RL frameworks do. Every replica stops at its
  next step boundary, all are given the weights, then all resume: a fleet-wide stall per sync.
A synchronous stage (max_staleness 0) and evaluations need every replica on the newest version
before they sample: `settle()` waits for a rolling update to finish.

A replica Ray restarts comes back without weights (it refuses to sample until given them); the
controller's recover() gives it the last published version. A replica out of restarts is dropped
from the router with a warning, and the run goes on with the replicas left.

Resizing (the allocator, with rollout.replicas = "auto"). A new replica joins under a fresh index
(indices are never reused, so an env worker's cached handle is never another actor) once it has
the newest weights, and only then is it routed to. A retired replica is routed no new group; it is
stopped once the groups it holds have come back (`reap`), so no turn of a group is cut short.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence

from lockstep.runtime.calls import ComponentError, is_component_loss, wait

log = logging.getLogger("lockstep.run")


class Router:
    """Which generator replica a prompt group goes to."""

    def __init__(self, replicas: int):
        self.outstanding = [0] * replicas
        self.live = list(range(replicas))

    def assign(self, groups: int) -> tuple[int, ...]:
        """A replica for each of `groups` new groups (counted outstanding until release)."""
        if not self.live:
            raise RuntimeError("no generator replica is left")
        routes = []
        for _ in range(groups):
            r = min(self.live, key=lambda i: (self.outstanding[i], i))
            self.outstanding[r] += 1
            routes.append(r)
        return tuple(routes)

    def release(self, routes: Sequence[int]) -> None:
        for r in routes:
            self.outstanding[r] -= 1

    def reset(self) -> None:
        self.outstanding = [0] * len(self.outstanding)

    def drop(self, replica: int) -> None:
        if replica in self.live:
            self.live.remove(replica)

    def add(self, replica: int) -> None:
        """Route to `replica` (an index never used before) from now on."""
        self.outstanding += [0] * (replica + 1 - len(self.outstanding))
        self.live.append(replica)


def replica_name(i: int) -> str:
    """Replica 0 is "generator" (as in a one-generator run); the others "generator1", ..."""
    return "generator" if i == 0 else f"generator{i}"


class GeneratorFleet:
    def __init__(self, replicas: list, timeout: float, sync: str = "rolling"):
        self.replicas, self.timeout, self.sync = list(replicas), timeout, sync
        """Every replica ever started, by index; a retired one is None once stopped."""
        self.router = Router(len(replicas))
        self.retiring: list[int] = []
        self.issued = len(self.replicas)
        """Indices handed out (`new_index`), started or not."""
        self._roller = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights-roll")
        self._roll: concurrent.futures.Future | None = None
        self.stalls: list[float] = []
        """Fleet-wide pauses (rollout.weight_sync = "pause"): seconds every replica was held."""

    @property
    def names(self) -> list[str]:
        return [replica_name(i) for i in range(len(self.replicas))]

    def live(self) -> dict:
        return {replica_name(i): self.replicas[i] for i in self.router.live}

    def index(self, name: str) -> int:
        return self.names.index(name)

    # -- size --------------------------------------------------------------------------------
    def new_index(self) -> int:
        """The index (and so the actor name, replica_name) of a replica about to be started."""
        self.issued += 1
        return self.issued - 1

    def add(self, index: int, actor) -> str:
        """Route to `actor`, started as replica `index`, from now on (it must already hold the
        newest weights); its name."""
        self.replicas += [None] * (index + 1 - len(self.replicas))
        self.replicas[index] = actor
        self.router.add(index)
        return replica_name(index)

    def retire(self) -> str:
        """Route no new group to the newest live replica; `reap` stops it once its groups are back."""
        assert len(self.router.live) > 1, "the last generator replica is never retired"
        i = self.router.live[-1]
        self.router.drop(i)
        self.retiring.append(i)
        return replica_name(i)

    def reap(self, kill) -> int:
        """Stop (with `kill`) the retired replicas no group is outstanding on; how many were."""
        done = [i for i in self.retiring if self.router.outstanding[i] <= 0]
        for i in done:
            kill(self.replicas[i])
            self.replicas[i] = None
            self.retiring.remove(i)
        return len(done)

    def actors(self) -> list:
        """Every replica not yet stopped, live or retiring."""
        return [r for r in self.replicas if r is not None]

    # -- weights -----------------------------------------------------------------------------
    def publish(self, version: int, lineage: str, weights_ref, *, background: bool) -> None:
        """Give every live replica `version` of the trainer's branch `lineage`. `background` (an
        asynchronous stage) rolls it out replica by replica while this returns; otherwise every
        replica has it parked on return."""
        self.settle()
        live, named = list(self.router.live), (version, lineage)
        if self.sync == "pause" and len(live) > 1:
            self._pause_and_swap(live, named, weights_ref)
        elif background and len(live) > 1:
            self._roll = self._roller.submit(self._roll_out, live, named, weights_ref)
        else:
            self._park(live, named, weights_ref)

    def settle(self) -> None:
        """Wait for a rolling update in progress; its non-loss errors surface here."""
        roll, self._roll = self._roll, None
        if roll is not None:
            roll.result()

    def _park(self, live: list[int], named: tuple[int, str], weights_ref) -> None:
        version, lineage = named
        now = time.time()
        wait([self.replicas[i].set_weights.remote(version, weights_ref, now, lineage) for i in live], self.timeout,
             "generator.set_weights")

    def _roll_out(self, live: list[int], named: tuple[int, str], weights_ref) -> None:
        """One replica at a time: park, then wait until it decodes with them (or is idle)."""
        version, lineage = named
        for i in live:
            try:
                wait(self.replicas[i].set_weights.remote(version, weights_ref, time.time(), lineage), self.timeout,
                     f"{replica_name(i)}.set_weights")
                wait(self.replicas[i].until_swapped.remote(self.timeout), self.timeout + 5,
                     f"{replica_name(i)}.until_swapped")
            except ComponentError as e:
                if not is_component_loss(e):
                    raise
                # lost: the loop notices through its rollouts, and recover() gives the replica's
                # next incarnation the last published weights

    def _pause_and_swap(self, live: list[int], named: tuple[int, str], weights_ref) -> None:
        """The fleet-wide pause: hold every replica at a step boundary, swap, release them all."""
        held = [self.replicas[i] for i in live]
        wait([r.hold.remote() for r in held], self.timeout, "generator.hold")
        t = time.perf_counter()
        try:
            wait([r.until_held.remote(self.timeout) for r in held], self.timeout + 5, "generator.until_held")
            self._park(live, named, weights_ref)
        finally:
            wait([r.release.remote() for r in held], self.timeout, "generator.release")
            self.stalls.append(time.perf_counter() - t)

    def close(self) -> None:
        self._roller.shutdown(wait=False, cancel_futures=True)
