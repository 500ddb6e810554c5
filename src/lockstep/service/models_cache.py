"""The engine host's memory: one byte-counted LRU of everything it holds.

Entries are shared bases, LoRA clients, full fine-tuning trainers, sampler skeletons and sampling
sessions, each counted at its tensor bytes (a trainer at what it holds once stepped: weights,
gradients and both AdamW moments, so a step never grows the total past the budget). An entry may
name the entry it runs on (a LoRA client its base, a full session its skeleton): using it touches
that one too, and an entry something resident still needs is never evicted.

Over the budget, the least recently used entries go first; each entry's `evict` callback decides
what leaving means (a trainer is spilled to storage and rebuilt exactly on its next use, a session
is reopened from its saved weights). Only the entry in use (and what it needs) is pinned, so a
request that fits the budget always finds room; one that cannot fit even alone is refused with the
budget in the message. Written here rather than with an LRU library (cachetools): eviction must
skip pinned entries and entries others depend on, and run a spill before dropping, which none does.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

log = logging.getLogger("lockstep.host")


class BudgetError(Exception):
    """An object that cannot fit in the model cache even alone (the message names the budget)."""


@dataclass
class Entry:
    value: Any
    """What is held (a SharedBase, an AdapterTrainer, a Trainer, a session)."""
    nbytes: int
    """Its tensor bytes, as counted against the budget."""
    kind: str
    """"base", "model", "skeleton" or "session": for per-kind count caps and messages."""
    needs: Hashable | None = None
    """The key of the entry it runs on (kept resident while this one is)."""
    evict: Callable[[], None] | None = None
    """Called before it leaves memory (a trainer's spill to storage)."""
    pins: int = field(default=0)
    """Held by a call in progress: never evicted meanwhile."""


class ModelCache:
    def __init__(self, budget_bytes: int, *, caps: dict[str, int] | None = None, flag: str = "--model-cache-mb"):
        if budget_bytes <= 0:
            raise ValueError(f"the model cache budget must be positive, got {budget_bytes} bytes")
        self.budget = int(budget_bytes)
        self.caps = {k: max(1, int(v)) for k, v in (caps or {}).items()}
        """Kind -> most entries of that kind held at once (the older count limits, e.g. max_models)."""
        self.flag = flag
        self.entries: OrderedDict[Hashable, Entry] = OrderedDict()

    # -- reading ---------------------------------------------------------------------------------
    def __contains__(self, key) -> bool:
        return key in self.entries

    @property
    def total(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def keys(self, kind: str) -> list:
        """Keys of one kind, least recently used first."""
        return [k for k, e in self.entries.items() if e.kind == kind]

    def peek(self, key):
        """The value without touching its recency (None when absent)."""
        entry = self.entries.get(key)
        return None if entry is None else entry.value

    def use(self, key):
        """The value, now the most recently used (and so is what it needs)."""
        entry = self.entries[key]
        if entry.needs is not None and entry.needs in self.entries:
            self.entries.move_to_end(entry.needs)
        self.entries.move_to_end(key)
        return entry.value

    # -- writing ---------------------------------------------------------------------------------
    def check_fits(self, nbytes: int, needs=None, *, what: str) -> None:
        """BudgetError when `nbytes` (with what it runs on) exceeds the whole budget."""
        total = nbytes + (self.entries[needs].nbytes if needs is not None and needs in self.entries else 0)
        if total > self.budget:
            raise BudgetError(f"{what} needs {_mib(total)} of worker memory (with the base it runs on), more than "
                              f"the worker's whole model cache budget of {_mib(self.budget)}; the operator sets "
                              f"it with `lockstep serve {self.flag}`")

    def put(self, key, value, nbytes: int, *, kind: str, needs=None, evict: Callable[[], None] | None = None) -> None:
        """Hold `value`, evicting least recently used entries until it fits (BudgetError, holding
        nothing new, when it cannot fit even alone)."""
        self.check_fits(nbytes, needs, what=f"{kind} {key}")
        old = self.entries.pop(key, None)
        self.entries[key] = Entry(value, int(nbytes), kind, needs, evict, old.pins if old else 0)
        self.use(key)
        self.make_room(protect=(key, needs))

    def pop(self, key) -> Any:
        """Remove without calling its evict callback (the caller drops it on purpose)."""
        entry = self.entries.pop(key, None)
        return None if entry is None else entry.value

    def pin(self, key) -> "_Pin":
        """`with cache.pin(key):` the entry (and what it needs) stays while a call uses it."""
        return _Pin(self, key)

    def make_room(self, protect=()) -> None:
        """Evict least recently used entries until the bytes and every kind's count fit."""
        protect = {k for k in protect if k is not None}
        protect |= {self.entries[k].needs for k in list(protect) if k in self.entries}
        while True:
            victim = self._victim(protect)
            if victim is None:
                return
            entry = self.entries[victim]
            if entry.evict is not None:
                entry.evict()  # may raise: then nothing was dropped and the caller's request fails
            del self.entries[victim]
            log.info("evicted %s %s from memory (%s; %s of %s held)", entry.kind, victim, _mib(entry.nbytes),
                     _mib(self.total), _mib(self.budget))

    def _victim(self, protect: set):
        """The oldest entry that may go, for whichever limit is exceeded; None when all fit."""
        needed = {e.needs for e in self.entries.values() if e.needs is not None}
        movable = [k for k, e in self.entries.items() if k not in protect and k not in needed and e.pins == 0]
        for kind, cap in self.caps.items():
            if len(self.keys(kind)) > cap:
                of_kind = [k for k in movable if self.entries[k].kind == kind]
                if of_kind:
                    return of_kind[0]
        if self.total <= self.budget:
            return None
        if not movable:  # everything left is in use: check_fits guarantees this is under budget
            log.warning("model cache over budget (%s of %s) with nothing evictable", _mib(self.total), _mib(self.budget))
            return None
        return movable[0]


class _Pin:
    def __init__(self, cache: ModelCache, key):
        self.cache, self.key = cache, key

    def __enter__(self):
        entry = self.cache.entries[self.key]
        entry.pins += 1
        return entry.value

    def __exit__(self, *exc):
        entry = self.cache.entries.get(self.key)
        if entry is not None:
            entry.pins -= 1


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (a view or a shared tensor counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), t.device.type)
        if key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total
