"""Run configuration: typed specs (types.py) and TOML loading with overrides (load.py)."""

from lockstep.config.load import RESCALABLE, apply_overrides, from_dict, load, rescale, to_dict
from lockstep.config.types import ConfigError, EnvSpec, ModelSpec, RunSpec, RuntimeSpec, StageSpec

__all__ = ["ConfigError", "EnvSpec", "ModelSpec", "RunSpec", "RuntimeSpec", "StageSpec",
           "RESCALABLE", "apply_overrides", "from_dict", "load", "rescale", "to_dict"]
