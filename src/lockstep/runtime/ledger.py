"""The exactly-once ledger of prompt groups: issued -> generated -> rewarded -> trained | filtered.

Every training group has an id. The ledger enforces the transitions (a group is never trained
twice; only a rewarded group is trained), keeps groups that must be issued again (replays) in
order, and is committed inside each trainer checkpoint (`snapshot()`), so the weights and the
ledger always agree. Resuming from a checkpoint restores its snapshot and replays every group
that was issued but not trained or filtered.

`ledger.jsonl` in the run directory is the append-only audit log of every transition, with a
`checkpoint` event written before each checkpoint is saved and a `resume` event naming the
checkpoint a resumed run started from. `audit()` replays it: rolling back to the named
checkpoint at each resume, it re-checks every transition, so a group trained twice in the
effective history of a run (across any number of kills and resumes) fails the audit.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterable

TERMINAL = ("trained", "filtered")


class LedgerError(RuntimeError):
    """An exactly-once violation: a bug, never a user error."""


class Ledger:
    def __init__(self, log_path: Path | None = None):
        self.state: dict[str, str] = {}
        """Group id -> its latest state; insertion order is first-issue order."""
        self.trained_step: dict[str, int] = {}
        self.filter_reason: dict[str, str] = {}
        self.attempts: dict[str, int] = {}
        self.replay: list[str] = []
        """Ids to issue again before any new group, oldest first."""
        self._log = open(log_path, "a", buffering=1) if log_path is not None else None

    # -- transitions -------------------------------------------------------------------------
    def _write(self, event: str, ids: Iterable[str] = (), **extra) -> None:
        if self._log is not None:
            self._log.write(json.dumps({"t": round(time.time(), 3), "event": event, "ids": list(ids), **extra}) + "\n")

    def _move(self, ids: list[str], allowed: tuple[str, ...], to: str) -> None:
        for gid in ids:
            now = self.state.get(gid, "new")
            if now not in allowed:
                raise LedgerError(f"group {gid}: {now} -> {to} is not allowed (from {allowed})")
            self.state[gid] = to

    def issue(self, ids: list[str]) -> None:
        self._move(ids, ("new", "queued"), "issued")
        for gid in ids:
            self.attempts[gid] = self.attempts.get(gid, 0) + 1
        queued = set(ids)
        self.replay = [g for g in self.replay if g not in queued]
        self._write("issued", ids)

    def generated(self, ids: list[str], at: float) -> None:
        self._move(ids, ("issued",), "generated")
        self._write("generated", ids, at=round(at, 3))

    def rewarded(self, ids: list[str], at: float) -> None:
        self._move(ids, ("generated",), "rewarded")
        self._write("rewarded", ids, at=round(at, 3))

    def trained(self, ids: list[str], step: int) -> None:
        self._move(ids, ("rewarded",), "trained")
        for gid in ids:
            self.trained_step[gid] = step
        self._write("trained", ids, step=step)

    def filtered(self, ids: list[str], reason: str) -> None:
        self._move(ids, ("rewarded", "issued", "generated", "queued"), "filtered")
        queued = set(ids)
        self.replay = [g for g in self.replay if g not in queued]
        for gid in ids:
            self.filter_reason[gid] = reason
        self._write("filtered", ids, reason=reason)

    def requeue(self, ids: list[str], reason: str) -> None:
        """Issue these again (stale, or lost with a crashed component)."""
        self._move(ids, ("issued", "generated", "rewarded"), "queued")
        self.replay.extend(ids)
        self._write("requeued", ids, reason=reason)

    # -- views -------------------------------------------------------------------------------
    def pending(self) -> list[str]:
        """Issued (or queued) but neither trained nor filtered."""
        return [g for g, s in self.state.items() if s not in TERMINAL]

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in ("issued", "generated", "rewarded", "queued", *TERMINAL)}
        for s in self.state.values():
            out[s] += 1
        return out

    # -- commit and resume -------------------------------------------------------------------
    def snapshot(self) -> dict:
        """What a checkpoint commits: terminal groups, and the pending ones in replay order."""
        pending = self.replay + [g for g in self.pending() if g not in set(self.replay)]
        return {"trained": dict(self.trained_step), "filtered": dict(self.filter_reason),
                "pending": pending, "attempts": dict(self.attempts)}

    def checkpoint(self, name: str) -> dict:
        """Log the intent to commit, then return the snapshot to save (a kill during the save
        leaves an event naming a checkpoint that does not exist, which no resume refers to)."""
        snap = self.snapshot()
        self._write("checkpoint", name=name)
        return snap

    @classmethod
    def restore(cls, snap: dict, log_path: Path | None = None, *, resumed_from: str | None = None) -> "Ledger":
        """The ledger of a checkpoint; every pending group is queued for replay, in order."""
        led = cls(log_path)
        for gid, step in snap["trained"].items():
            led.state[gid], led.trained_step[gid] = "trained", int(step)
        for gid, reason in snap["filtered"].items():
            led.state[gid], led.filter_reason[gid] = "filtered", reason
        for gid in snap["pending"]:
            led.state[gid] = "queued"
        led.replay = list(snap["pending"])
        led.attempts = {g: int(n) for g, n in snap.get("attempts", {}).items()}
        if resumed_from is not None:
            led._write("resume", name=resumed_from)
        return led

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def audit(log_path: Path) -> Ledger:
    """Replay ledger.jsonl through the transition rules, rolling back at each resume to the
    checkpoint it names; raises LedgerError on any violation. Returns the effective ledger."""
    led, snaps = Ledger(), {}
    for line in Path(log_path).read_text().splitlines():
        if not line.strip():
            continue
        ev = json.loads(line)
        kind, ids = ev["event"], ev["ids"]
        if kind == "checkpoint":
            snaps[ev["name"]] = led.snapshot()
        elif kind == "resume" and ev["name"] == "":  # restarted from the base model
            led = Ledger()
        elif kind == "resume":
            if ev["name"] not in snaps:
                raise LedgerError(f"resume from {ev['name']!r}, which the log never checkpointed")
            led = Ledger.restore(snaps[ev["name"]])
        elif kind == "issued":
            led.issue(ids)
        elif kind in ("generated", "rewarded"):
            getattr(led, kind)(ids, ev["at"])
        elif kind == "trained":
            led.trained(ids, ev["step"])
        elif kind == "filtered":
            led.filtered(ids, ev["reason"])
        elif kind == "requeued":
            led.requeue(ids, ev["reason"])
        else:
            raise LedgerError(f"unknown ledger event {kind!r}")
    return led
