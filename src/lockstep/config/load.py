"""TOML (and dict) -> RunSpec, with unknown keys rejected and dotted command-line overrides.

Stages are a TOML array of tables (`[[stages]]`); on the command line a stage is addressed by
index (`stages.1.learning_rate=3e-4`) or, when only one stage has that kind, by kind
(`rl.max_staleness=2`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import typing
from pathlib import Path
from typing import Any, Sequence

from lockstep.config.types import (ConfigError, EnvSpec, ModelSpec, RolloutSpec, RunSpec, RuntimeSpec, StageSpec,
                                   TrainSpec)
from lockstep.sandbox.types import LimitsError

_SECTIONS = {"model": ModelSpec, "env": EnvSpec, "runtime": RuntimeSpec, "rollout": RolloutSpec, "train": TrainSpec}


def _suggest(key: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(options)}"


def _coerce(path: str, value: Any, annotation) -> Any:
    args = typing.get_args(annotation)
    if type(None) in args:  # `X | None`: None (JSON null) leaves the default to the spec
        if value is None:
            return None
        annotation = next(a for a in args if a is not type(None))
    kind = typing.get_origin(annotation) or annotation
    if kind is typing.Literal or isinstance(annotation, str):
        return value
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation in (int, float, str, bool) and (type(value) is not annotation):
        raise ConfigError(f"{path}: expected {annotation.__name__}, got {type(value).__name__} {value!r}")
    if annotation is dict and not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a table, got {type(value).__name__} {value!r}")
    return value


def _build(cls, data: dict, path: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(f"{path}.{key}: unknown key{_suggest(key, fields)}")
    kwargs = {k: _build(hints[k], v, f"{path}.{k}") if dataclasses.is_dataclass(hints[k])
              else _coerce(f"{path}.{k}", v, hints[k]) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except LimitsError as e:  # the sandbox's own spec validates itself, naming the key
        raise ConfigError(f"{path}.{e}") from None


def from_dict(data: dict) -> RunSpec:
    top = {f.name for f in dataclasses.fields(RunSpec)}
    for key in data:
        if key not in top:
            raise ConfigError(f"{key}: unknown key{_suggest(key, top)}")
    kwargs: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        if name in data:
            kwargs[name] = _build(cls, data[name], name)
    if "stages" in data:
        stages = data["stages"]
        if not isinstance(stages, list):
            raise ConfigError("stages: expected an array of tables ([[stages]])")
        kwargs["stages"] = tuple(_build(StageSpec, s, f"stages[{i}]") for i, s in enumerate(stages))
    if "seed" in data:
        kwargs["seed"] = _coerce("seed", data["seed"], int)
    return RunSpec(**kwargs)


def to_dict(spec: RunSpec) -> dict:
    d = dataclasses.asdict(spec)
    d["stages"] = [dict(s) for s in d["stages"]]
    return d


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word is a string: env.name=arithmetic


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply `a.b=value` overrides to a raw config dict (before validation)."""
    data = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        value = _parse_value(text.strip())
        if parts[0] in ("sft", "rl"):
            parts = ["stages", str(_stage_index(data, parts[0])), *parts[1:]]
        if parts[0] == "stages":
            _default_stages(data)
        node = data
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"{key}: no stage {part!r} (there are {len(node)})")
                node = node[int(part)]
            else:
                node = node.setdefault(part, {})
        if isinstance(node, list):
            raise ConfigError(f"{key}: expected stages.<index>.<key>")
        node[parts[-1]] = value
    return data


def _default_stages(data: dict) -> list:
    """Overrides of stages apply to the default stage list when the file has none."""
    return data.setdefault("stages", [dataclasses.asdict(s) for s in RunSpec().stages])


def _stage_index(data: dict, kind: str) -> int:
    stages = _default_stages(data)
    matches = [i for i, s in enumerate(stages) if s.get("kind", "rl") == kind]
    if len(matches) != 1:
        raise ConfigError(f"{kind}.*: {len(matches)} stages have kind {kind!r}; address one as stages.<index>.<key>")
    return matches[0]


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunSpec:
    """Read a TOML (or, for the job service, JSON) file (None: the embedded default), apply
    overrides, validate."""
    data: dict = {}
    if path is not None:
        try:
            text = Path(path).read_text()
            data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a table of sections at the top level")
    return from_dict(apply_overrides(data, overrides))


RESCALABLE = ("train.replicas", "rollout.replicas", "rollout.max_replicas", "rollout.weight_sync", "runtime.cpus",
              "runtime.gpus", "runtime.placement", "runtime.env_workers", "runtime.trainer_threads", "runtime.generator_threads",
              "runtime.allocator", "runtime.allocator_window", "runtime.call_timeout_s", "runtime.max_restarts",
              "runtime.allow_mixed_forward")
"""What `lockstep run --resume DIR key=value` may change: where and on how many processes the run
goes on, none of what it computes (the forward is batch and thread invariant, a sync run is the
same on any number of generator replicas, and a step's micro-batches are pinned below)."""


def rescale(spec: RunSpec, overrides: Sequence[str]) -> RunSpec:
    """`spec` (a run's config.json) with scale-out overrides for a resume, e.g. on more nodes.
    train.replicas may change only where the step's micro-batches stay those of the checkpointed
    run: micro_batches 0 (one per replica) is pinned to the old count, and more replicas than
    micro-batches is refused, since a step accumulated over other micro-batches is not the same step."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key not in RESCALABLE:
            raise ConfigError(f"--resume: {key} cannot change when a run resumes (the continued run would not be the "
                              f"one checkpointed); these can: {', '.join(RESCALABLE)}")
    data = to_dict(spec)
    data["train"]["micro_batches"] = spec.train.micro
    data = apply_overrides(data, overrides)
    replicas = data["train"]["replicas"]
    if isinstance(replicas, int) and replicas > spec.train.micro:
        raise ConfigError(f"--resume: train.replicas = {replicas} would need at least {replicas} micro-batches a "
                          f"step, but this run accumulates {spec.train.micro} (train.micro_batches), and a step "
                          f"over other micro-batches is not the same step; resume with train.replicas <= "
                          f"{spec.train.micro}")
    return from_dict(data)
