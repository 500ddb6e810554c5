"""Every component that runs the model computes the trainer's bits, or it does not take part.

The trainer (rank 0) is the reference: the sampler's logprobs are compared with its logprobs (the
mismatch panel) and trained on as the behaviour policy's. Each trainer rank and generator replica
reports a ForwardFingerprint (engine/fingerprint.py) in its stats(); the controller compares them
with the trainer's at start, when the allocator adds a replica, and when Ray restarts an actor
(it may come back on another node). Draft models are not compared: a draft only proposes tokens,
which the target's own forward accepts or resamples (engine/speculative.py).

At start a difference refuses the run (MixedForward names the component, the field and both
values). Later, a replica that differs is kept out of the fleet with a warning (counted in
runtime/forward_refused) and the run goes on with the others; it fails when none would be left,
or when a trainer rank differs. runtime.allow_mixed_forward = true runs with every component,
logs the differences and counts them (runtime/mixed_forward); what they cost is then measured by
the mismatch panel (metrics mismatch/*).
"""

from __future__ import annotations

import dataclasses

from lockstep.config.types import ConfigError
from lockstep.engine.types import ForwardFingerprint

REFERENCE = "trainer"

FIX = ("make the nodes match (docs/deploy.md, \"What must match across nodes\"), or set runtime.allow_mixed_forward "
       "= true to run anyway and measure the mismatch (metrics mismatch/*)")


class MixedForward(ConfigError):
    """Components of a run would compute different bits: the message names each, and the fields."""


def reported(stats: dict[str, dict]) -> dict[str, ForwardFingerprint]:
    """The fingerprints in actors' stats() (actor name -> stats): the trainer's ranks as "trainer
    rank N"; actors that do not run the model (env workers) report none."""
    out = {}
    for name, s in stats.items():
        if "forward" in s:
            out[name] = s["forward"]
        for rank, fp in enumerate(s.get("rank_forwards", ()), start=1):
            out[f"{name} rank {rank}"] = fp
    return out


def differing(forwards: dict[str, ForwardFingerprint]) -> dict[str, tuple[str, ...]]:
    """Per component whose forward differs from the trainer's, what differs."""
    ref = forwards[REFERENCE]
    out = {}
    for name, fp in forwards.items():
        d = fp.differences(ref)
        if d:
            out[name] = d
    return out


def describe(diffs: dict[str, tuple[str, ...]]) -> str:
    """"generator1 would compute other bits than the trainer: path 'eager' vs 'fused', ..." per
    component (its value first, the trainer's second)."""
    return "; ".join(f"{name} would compute other bits than the {REFERENCE}: {', '.join(d)}"
                     for name, d in diffs.items())


def refusal(diffs: dict[str, tuple[str, ...]]) -> MixedForward:
    return MixedForward(f"{describe(diffs)}. To fix: {FIX}")


def report(forwards: dict[str, ForwardFingerprint]) -> dict:
    """forward.json: every component's fingerprint and what differs from the trainer's."""
    return {"components": {name: dataclasses.asdict(fp) for name, fp in forwards.items()},
            "differences": {name: list(d) for name, d in differing(forwards).items()}}
