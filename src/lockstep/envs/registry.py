"""`[env]` -> an EnvSuite: built-in suites by name, a user's own as "module:function"."""

from __future__ import annotations

import importlib

from lockstep.config.types import EnvSpec
from lockstep.envs.types import EnvError, EnvSuite

BUILTIN = {
    "arithmetic": "lockstep.envs.arithmetic:make_suite",
    "math": "lockstep.envs.math:make_suite",
    "reasoning_gym": "lockstep.envs.reasoning_gym:make_suite",
}


def resolve_factory(name: str):
    """The suite factory for `env.name`, imported by its "module:function" path."""
    target = BUILTIN.get(name, name)
    module_name, _, func_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvError(f"env.name: cannot import module {module_name!r} ({e})") from None
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise EnvError(f"env.name: {module_name!r} has no function {func_name!r}")
    return factory


def make_suite(spec: EnvSpec, tokenizer, *, seed: int) -> EnvSuite:
    """Build the suite `spec` names; data files are read here, so bad data fails before any work."""
    return resolve_factory(spec.name)(spec, tokenizer, seed)
