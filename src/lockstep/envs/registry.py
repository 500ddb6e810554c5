"""`[env]` -> an EnvSuite: built-in suites by name, a user's own as "module:function".

A user suite imports a module, which runs its code. `lockstep run` on your own machine imports
any module; under the job service the worker sets `LOCKSTEP_ENV_MODULES` to the operator's
allowlist (empty: built-in suites only), and the job process refuses anything else itself, even
if a spec reached it without the API's checks.
"""

from __future__ import annotations

import importlib
import os

from lockstep.config.types import EnvSpec
from lockstep.envs.types import EnvError, EnvSuite

BUILTIN = {
    "arithmetic": "lockstep.envs.arithmetic:make_suite",
    "long_addition": "lockstep.envs.arithmetic:make_long_suite",
    "math": "lockstep.envs.math:make_suite",
    "reasoning_gym": "lockstep.envs.reasoning_gym:make_suite",
    "code": "lockstep.envs.code:make_suite",
    "python_tool": "lockstep.envs.python_tool:make_suite",
}
ALLOWLIST_ENV = "LOCKSTEP_ENV_MODULES"
"""Comma-separated modules a user suite may come from (a module covers its submodules; "*": any)."""


def split_target(name: str) -> tuple[str, str]:
    """("module", "function") of a user suite's name; EnvError unless both are dotted identifiers
    (no relative imports, no paths, no attribute chains)."""
    module, sep, func = name.partition(":")
    if not sep or not func.isidentifier() or not module or not all(p.isidentifier() for p in module.split(".")):
        raise EnvError(f"env.name {name[:100]!r}: expected a built-in suite {sorted(BUILTIN)} or 'module:function' "
                       f"with an absolute, dotted module name")
    return module, func


def module_allowed(module: str, allowlist) -> bool:
    """Whether `module` is an entry of `allowlist` or a submodule of one ("*" allows any)."""
    return any(entry == "*" or module == entry or module.startswith(entry + ".") for entry in allowlist)


def check_name(name: str, allowlist) -> None:
    """EnvError unless `name` is a built-in suite or a user suite from an allowed module."""
    if name in BUILTIN:
        return
    module, _ = split_target(name)
    if not module_allowed(module, allowlist):
        allowed = f"allowed modules: {sorted(allowlist)}" if allowlist else "this server allows built-in suites only"
        raise EnvError(f"env.name {name[:100]!r}: module {module[:100]!r} is not allowed ({allowed}; "
                       f"built-in: {sorted(BUILTIN)})")


def resolve_factory(name: str):
    """The suite factory for `env.name`, imported by its "module:function" path."""
    if name not in BUILTIN and ALLOWLIST_ENV in os.environ:
        check_name(name, [m.strip() for m in os.environ[ALLOWLIST_ENV].split(",") if m.strip()])
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
