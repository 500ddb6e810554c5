"""The operator's policy for jobs: what a tenant's job may ask the worker to do.

A job spec is a `lockstep run` config, and `lockstep run` on your own machine trusts its config:
it imports any "module:function" env, reads any data file and loads any model directory. Under the
service every such field is a reference the server resolves, never a path:

- `env.name`: a built-in suite, or a user module the operator allowlisted (`user_env_modules`);
- `model.path`: "builtin", a registered base model by name, or `job:<id>`, the final model of one
  of the tenant's own succeeded jobs;
- `env.path`, `env.test_path`, `stages[].dataset`: a dataset id (`ds-...`) the tenant uploaded
  through `POST /v1/datasets`;

and sizes are capped (`Limits`). Defaults are safe: with no policy file, built-in envs only and
the caps below. A policy file (TOML, `lockstep serve --policy FILE`) sets any cap at the top level
and per tenant under `[tenants.NAME]`. The API checks every spec before storing it; the scheduler
checks the stored spec again, with the worker's own policy, before each attempt.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from sqlalchemy import select

from lockstep.config.types import RunSpec
from lockstep.service.db import BaseModelEntry, Dataset, Job
from lockstep.service.types import JobState, ServiceError

MiB = 1024 * 1024


_LEAST = {"max_job_gpus": 0, "event_keepalive_s": 0.01, "event_poll_s": 0.01, "batch_weight": 0.01}
"""Caps that may be below 1 (0: off; the stream intervals); every other cap is at least 1."""
GLOBAL_ONLY = ("max_event_streams_total", "event_keepalive_s", "event_poll_s")
"""Keys of the API process as a whole: top level only, refused under [tenants.NAME]."""


@dataclass(frozen=True)
class Limits:
    """Caps on one job (and one tenant's datasets, queue and event streams). Each applies per job;
    the policy file may set them per tenant, but for GLOBAL_ONLY ones."""

    user_env_modules: tuple[str, ...] = ()
    """Modules a "module:function" env may come from (a module covers its submodules; "*": any).
    Empty: built-in suites only. An allowed module runs with the worker's privileges."""
    max_stages: int = 8
    max_steps: int = 10_000
    """Optimizer steps over all stages."""
    max_batch_size: int = 1024
    """stages[].batch_size (sft examples per step)."""
    max_prompts_per_step: int = 256
    max_group_size: int = 64
    max_env_workers: int = 8
    """runtime.env_workers (env worker actors)."""
    max_threads: int = 8
    """runtime.generator_threads and runtime.trainer_threads, each."""
    max_restarts: int = 5
    """runtime.max_restarts (Ray restarts of a crashed actor)."""
    max_keep_checkpoints: int = 10
    max_env_size: int = 100_000
    """env.size (problems drawn from a procedural task)."""
    max_num_heldout: int = 5_000
    max_pass_k: int = 64
    max_tokens: int = 2_048
    """env.max_tokens (tokens sampled per turn)."""
    max_turns: int = 16
    max_env_retries: int = 10
    max_lora_rank: int = 256
    max_train_replicas: int = 4
    """train.replicas (trainer processes of a job)."""
    max_micro_batches: int = 256
    max_rollout_replicas: int = 4
    """rollout.replicas and rollout.max_replicas (generator processes of a job)."""
    max_fork_branches: int = 8
    """rollout.fork.branches (continuations per forked episode)."""
    max_job_gpus: int = 0
    """GPUs a job may use with model.device = "cuda" (runtime.gpus; the scheduler gives a job this
    many when it asks for the machine's, -1). 0: jobs run on CPU only and a CUDA spec is refused."""
    max_sandbox_wall_s: float = 60.0
    """env.sandbox.wall_s; the other env.sandbox limits have their own caps below."""
    max_sandbox_cpu_s: int = 30
    max_sandbox_memory_mb: int = 2048
    max_sandbox_processes: int = 64
    max_sandbox_file_size_mb: int = 64
    max_sandbox_open_files: int = 256
    max_sandbox_output_kb: int = 1024
    max_sandbox_tmpfs_mb: int = 256
    max_job_memory_mb: int = 16_384
    """Memory of a job, all its processes together (`lockstep run` and its Ray actors), where the
    worker has a cgroup for it; else each process's address space (RLIMIT_AS: a tiny job's
    processes map 9.2 GB each, so keep this above ~12 GiB there). A job over it is stopped and
    fails with a message naming this cap (see lockstep/memlimit.py)."""
    max_wall_seconds: float = 6 * 3600.0
    """Running time of a job, over all its attempts; the scheduler stops and fails a job past it."""
    max_spec_bytes: int = 64 * 1024
    """A spec's size as JSON."""
    max_queued_jobs: int = 100
    """Jobs a tenant may have waiting at once."""
    max_dataset_bytes: int = 32 * MiB
    """One uploaded dataset (the API's --max-body-mb bounds it too)."""
    max_dataset_decoded_bytes: int = 512 * MiB
    """One dataset's rows once decoded: the memory they take as Python objects, parquet dictionaries
    expanded (envs/datafile.py; a jsonl file takes ~3x its size in rows of a few KB, ~7x in rows of
    ~60 bytes, up to ~20x in rows of a few characters). The upload counts them and refuses a dataset
    past it; a job stops reading a data file past it ($LOCKSTEP_DATA_BUDGET_BYTES)."""
    dataset_quota_bytes: int = 1024 * MiB
    """A tenant's datasets, all together."""
    max_datasets: int = 100
    max_event_streams: int = 32
    """`GET /v1/jobs/ID/events` streams a tenant may hold open at once (in one API process); the
    next one is a 429 naming this cap."""
    max_event_streams_total: int = 1024
    """Event streams open at once in one API process, all tenants together (top level only)."""
    event_stream_idle_s: float = 600.0
    """A stream that sent no event for this long ends with an `idle` event (the client reconnects
    with ?after=)."""
    event_keepalive_s: float = 15.0
    """An SSE comment line goes down an idle stream this often (top level only), so proxies and
    clients see a live connection and a dead client is noticed."""
    event_poll_s: float = 0.5
    """How often the API's one change notifier reads the store for new job events (top level
    only): the longest an event written by the worker waits to reach its streams."""
    stability_quota_tokens: int = 4_000_000
    """Tokens of recorded samples (`record_stability_info`: prompt + max_tokens per sequence) a
    tenant may hold at once; records last a day from sampling or their last training use
    (service/stability.py). A sample past it is a 429 naming this cap."""
    batch_weight: float = 1.0
    """The tenant's weight in the Executor's packed batches (service/packing.py): backlogged
    tenants share each batch's token budget, and executor time, in proportion to their weights."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "user_env_modules":
                if not all(isinstance(m, str) and (m == "*" or all(p.isidentifier() for p in m.split("."))) for m in v):
                    raise PolicyError(f"user_env_modules: expected dotted module names or '*', got {list(v)!r}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < _LEAST.get(f.name, 1):
                raise PolicyError(f"{f.name}: expected a number >= {_LEAST.get(f.name, 1)}, got {v!r}")



class PolicyError(ValueError):
    """An invalid policy file: the message names the key."""


POLICY_ENV = "LOCKSTEP_POLICY"
"""A policy file the worker's scheduler reads (`lockstep serve/worker --policy` set it)."""


@dataclass(frozen=True)
class Policy:
    limits: Limits = field(default_factory=Limits)
    tenants: Mapping[str, Limits] = field(default_factory=dict)
    """Tenant name -> its limits (the defaults overridden by its `[tenants.NAME]` table)."""

    def for_tenant(self, name: str) -> Limits:
        return self.tenants.get(name, self.limits)

    @classmethod
    def from_dict(cls, data: dict) -> Policy:
        data = dict(data)
        tenants = data.pop("tenants", {})
        if not isinstance(tenants, dict) or not all(isinstance(v, dict) for v in tenants.values()):
            raise PolicyError("tenants: expected tables [tenants.NAME]")
        base = _limits({}, data, "")
        for name, over in tenants.items():
            if key := next((k for k in over if k in GLOBAL_ONLY), None):
                raise PolicyError(f"tenants.{name}.{key}: a setting of the whole API process; set it at the top level")
        return cls(base, {name: _limits(dataclasses.asdict(base), over, f"tenants.{name}.")
                          for name, over in tenants.items()})

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        try:
            return cls.from_dict(tomllib.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise PolicyError(f"policy file {str(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise PolicyError(f"{path}: invalid TOML: {e}") from None
        except PolicyError as e:
            raise PolicyError(f"{path}: {e}") from None


def _limits(base: dict, over: dict, where: str) -> Limits:
    names = [f.name for f in dataclasses.fields(Limits)]
    for key in over:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            raise PolicyError(f"{where}{key}: unknown key" + (f"; did you mean {close[0]!r}?" if close else
                                                             f"; valid keys: {names}"))
    merged = {**base, **over}
    if "user_env_modules" in merged:
        if not isinstance(merged["user_env_modules"], (list, tuple)):
            raise PolicyError(f"{where}user_env_modules: expected a list of module names")
        merged["user_env_modules"] = tuple(merged["user_env_modules"])
    try:
        return Limits(**merged)
    except PolicyError as e:
        raise PolicyError(f"{where}{e}") from None


def from_env() -> Policy:
    """The policy file named by $LOCKSTEP_POLICY, or the safe defaults."""
    path = os.environ.get(POLICY_ENV)
    return Policy.load(path) if path else Policy()


# -- checking a spec -----------------------------------------------------------------------------
DATASET_ID = re.compile(r"ds-[0-9a-f]{16}")
JOB_MODEL = re.compile(r"job:([0-9a-f]{16})")
DATA_FIELDS = ("env.path", "env.test_path")
MAX_DEPTH = 8
MAX_STRING = 4096
INT64 = 2**63

_CAPS = (  # (cap, the spec fields it bounds)
    ("max_batch_size", ("stages[].batch_size",)), ("max_prompts_per_step", ("stages[].prompts_per_step",)),
    ("max_group_size", ("stages[].group_size",)), ("max_env_workers", ("runtime.env_workers",)),
    ("max_threads", ("runtime.generator_threads", "runtime.trainer_threads")),
    ("max_restarts", ("runtime.max_restarts",)), ("max_keep_checkpoints", ("runtime.keep_checkpoints",)),
    ("max_env_size", ("env.size",)), ("max_num_heldout", ("env.num_heldout",)), ("max_pass_k", ("env.pass_k",)),
    ("max_tokens", ("env.max_tokens",)), ("max_turns", ("env.max_turns",)), ("max_env_retries", ("env.retries",)),
    ("max_lora_rank", ("model.lora_rank",)), ("max_fork_branches", ("rollout.fork.branches",)),
    ("max_train_replicas", ("train.replicas",)), ("max_micro_batches", ("train.micro_batches",)),
    ("max_rollout_replicas", ("rollout.replicas", "rollout.max_replicas")),
    *((f"max_sandbox_{name}", (f"env.sandbox.{name}",)) for name in (
        "wall_s", "cpu_s", "memory_mb", "processes", "file_size_mb", "open_files", "output_kb", "tmpfs_mb")),
)


def _shape(value: Any, path: str, depth: int = 0) -> None:
    """Bounded JSON: nesting, string lengths, 64-bit integers and finite numbers (a job process,
    the store and numpy seeds all break on the rest)."""
    if depth > MAX_DEPTH:
        raise ServiceError(f"spec: {path or 'spec'} is nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        for k, v in value.items():
            _shape(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _shape(v, f"{path}[{i}]", depth + 1)
    elif isinstance(value, str):
        if len(value) > MAX_STRING:
            raise ServiceError(f"spec: {path} is longer than {MAX_STRING} characters")
    elif isinstance(value, bool) or value is None:
        pass
    elif isinstance(value, int):
        if not -INT64 <= value < INT64:
            raise ServiceError(f"spec: {path} = {value} does not fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ServiceError(f"spec: {path} must be a finite number, got {value}")


def _values(d: dict, field_path: str):
    """(path, value) of a dotted field, `stages[]` meaning each stage."""
    head, _, rest = field_path.partition(".")
    if head == "stages[]":
        for i, stage in enumerate(d["stages"]):
            yield f"stages[{i}].{rest}", stage[rest]
    else:
        value = d[head]
        for part in rest.split("."):  # nested tables: rollout.fork.branches, env.sandbox.wall_s
            value = value[part]
        yield field_path, value


def check_spec(spec: dict, limits: Limits) -> RunSpec:
    """The parsed RunSpec of a job spec that this policy allows; ServiceError (400) naming the
    field and the cap otherwise. References are checked for form here, for existence in resolve()."""
    from lockstep.config import ConfigError, from_dict, to_dict
    from lockstep.envs.registry import check_name
    from lockstep.envs.types import EnvError

    if not isinstance(spec, dict):
        raise ServiceError("spec: expected a JSON object of run config sections")
    _shape(spec, "")
    size = len(json.dumps(spec))
    if size > limits.max_spec_bytes:
        raise ServiceError(f"spec: {size} bytes as JSON is over this server's cap max_spec_bytes = {limits.max_spec_bytes}")
    try:
        run = from_dict(spec)
    except (ConfigError, TypeError, ValueError) as e:
        raise ServiceError(f"spec: {e}") from None
    d = to_dict(run)  # (RunSpec itself checked each RL stage's loss and its config: config.types.check_loss)
    if run.runtime.ray_address:
        raise ServiceError("spec: runtime.ray_address is set by the service; leave it empty")
    if not 0 <= run.seed < 2**32:
        raise ServiceError(f"spec: seed must be in [0, 2^32), got {run.seed}")
    try:
        check_name(run.env.name, limits.user_env_modules)
    except EnvError as e:
        raise ServiceError(f"spec: {e}") from None
    _check_caps(d, limits)
    _check_gpus(run, limits)
    _check_references(d)
    return run


def _check_gpus(run: RunSpec, limits: Limits) -> None:
    if run.model.device != "cuda":
        return
    if limits.max_job_gpus == 0:
        raise ServiceError("spec: model.device = 'cuda': this server runs jobs on CPU only (max_job_gpus = 0); "
                           "set model.device = 'cpu'")
    if run.runtime.gpus > limits.max_job_gpus:
        raise _over("runtime.gpus", run.runtime.gpus, "max_job_gpus", limits.max_job_gpus)


def _over(path: str, value, cap: str, limit, what: str = "") -> ServiceError:
    return ServiceError(f"spec: {path} = {value} is over this server's cap {cap} = {limit}{what}")


def _check_caps(d: dict, limits: Limits) -> None:
    if len(d["stages"]) > limits.max_stages:
        raise _over("len(stages)", len(d["stages"]), "max_stages", limits.max_stages)
    steps = sum(s["steps"] for s in d["stages"])
    if steps > limits.max_steps:
        raise _over("sum(stages[].steps)", steps, "max_steps", limits.max_steps, " (optimizer steps of all stages)")
    for cap, fields in _CAPS:
        limit = getattr(limits, cap)
        for f in fields:
            for path, value in _values(d, f):
                if value == "auto":  # rollout.replicas: resolved within the job's CPU share (runtime/plan.py)
                    continue
                if value > limit:
                    raise _over(path, value, cap, limit)


def _check_references(d: dict) -> None:
    path = d["model"]["path"]
    if path.startswith("/") or path.startswith(".") or "\\" in path or ".." in path.split("/") or "\x00" in path:
        raise ServiceError(f"spec: model.path {path[:100]!r}: a path on the server is not accepted; use 'builtin', "
                           f"a registered base model's name, or job:<id> of one of your succeeded jobs")
    draft = d.get("rollout", {}).get("speculative", {}).get("draft_model", "")
    if draft:
        raise ServiceError(f"spec: rollout.speculative.draft_model {str(draft)[:100]!r}: a path on the server is not "
                           "accepted; leave it empty (the model drafter starts from the policy's own first layers)")
    for f, value in data_fields(d):
        if value and not DATASET_ID.fullmatch(value):
            raise ServiceError(f"spec: {f} {value[:100]!r}: expected a dataset id (ds-...) from POST /v1/datasets "
                               f"(`lockstep dataset upload FILE`); paths on the server are not accepted")


def data_fields(d: dict) -> list[tuple[str, str]]:
    """(field, value) of every data-file field of a spec dict."""
    out = [(f, d["env"][f.split(".")[1]]) for f in DATA_FIELDS]
    return out + [(f"stages[{i}].dataset", s["dataset"]) for i, s in enumerate(d["stages"])]


# -- resolving references ------------------------------------------------------------------------
@dataclass(frozen=True)
class Inputs:
    """What a job's references resolve to, on the server's side."""

    model_kind: str
    """"builtin", "base" (a registered base model) or "job" (a final model in storage)."""
    model: str
    """base: its directory on the workers; job: its storage key; builtin: ""."""
    datasets: Mapping[str, str] = field(default_factory=dict)
    """Dataset id -> its storage key."""


def resolve(s, tenant_id: str, d: dict) -> Inputs:
    """Resolve a checked spec dict's references for `tenant_id`; another tenant's object is
    reported exactly like a missing one."""
    path = d["model"]["path"]
    if path == "builtin":
        kind, model = "builtin", ""
    elif m := JOB_MODEL.fullmatch(path):
        job = s.get(Job, m.group(1))
        if job is None or job.tenant_id != tenant_id or job.state != JobState.SUCCEEDED.value:
            raise ServiceError(f"spec: model.path {path!r}: none of your succeeded jobs has this id")
        kind, model = "job", final_model_key(job.tenant_id, job.id)
    else:
        entry = s.get(BaseModelEntry, path)
        if entry is None:
            names = sorted(s.scalars(select(BaseModelEntry.name)))
            raise ServiceError(f"spec: model.path {path[:100]!r} is not a registered base model ({names}), 'builtin' "
                               f"or job:<id> of one of your succeeded jobs")
        kind, model = "base", entry.path
    datasets = {}
    for f, value in data_fields(d):
        if value:
            ds = s.get(Dataset, value)
            if ds is None or ds.tenant_id != tenant_id:
                raise ServiceError(f"spec: {f}: you have no dataset {value!r} (upload one with POST /v1/datasets)")
            datasets[value] = ds.storage_key
    return Inputs(kind, model, datasets)


def final_model_key(tenant_id: str, job_id: str) -> str:
    return f"jobs/{tenant_id}/{job_id}/final_model"
