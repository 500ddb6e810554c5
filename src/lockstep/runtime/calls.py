"""Remote calls with deadlines, and telling a lost component from a failed call.

Every call between the runtime's components goes through `wait`: a hang becomes a ComponentError
naming the call and the setting that bounds it, and a dead actor a ComponentError whose cause
`is_component_loss` recognises (the callers then recover and replay instead of failing).
"""

from __future__ import annotations

import ray

from lockstep.runtime.types import ActorRestarted


class ComponentError(RuntimeError):
    """A component failed or missed its deadline."""


class ComponentDead(ComponentError):
    """An actor died and Ray has no restarts left for it (runtime.max_restarts)."""


def is_component_loss(e: BaseException) -> bool:
    """A call failed because an actor (possibly one it called) died or was restarting."""
    seen = 0
    if isinstance(e, ComponentDead):
        return False
    while e is not None and seen < 8:
        if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ActorRestarted)):
            return True
        e, seen = getattr(e, "cause", None) or e.__cause__, seen + 1
    return False


def wait(ref, timeout: float, what: str):
    """ray.get with a deadline: a hang or a dead actor becomes a clear error, never a stall."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise ComponentError(f"{what} did not answer within {timeout:.0f}s (runtime.call_timeout_s)") from None
    except Exception as e:
        if is_component_loss(e):
            raise ComponentError(f"{what}: a component died ({e.__class__.__name__}); see the Ray worker logs") from e
        raise
