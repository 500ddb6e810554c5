"""The service's contract: request kinds and states, job states and their transitions, errors.

Torch-free and Ray-free: the API process imports this, the store, the wire codecs and nothing of
the engine. Requests become rows in the store; workers claim them, execute them and write the
results back (see docs/architecture.md, "Service").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from lockstep.config.types import LOSSES, ConfigError
from lockstep.config.types import check_loss as _check_loss


class ServiceError(Exception):
    """A request the service refuses. `status` is the HTTP status; the message says what to fix."""

    status = 400
    category = "user"

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class NotFound(ServiceError):
    """Unknown object, or one that belongs to another tenant (indistinguishable on purpose)."""

    status = 404


class Conflict(ServiceError):
    status = 409


class Unauthorized(ServiceError):
    status = 401


class QuotaExceeded(ServiceError):
    status = 429


class RequestKind(str, enum.Enum):
    """What a queued request asks a worker to do (the Tinker request types)."""

    CREATE_MODEL = "create_model"
    LOAD_WEIGHTS = "load_weights"
    FORWARD_BACKWARD = "forward_backward"
    FORWARD = "forward"
    OPTIM_STEP = "optim_step"
    SAVE_WEIGHTS = "save_weights"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    SAVE_WEIGHTS_EXTERNAL = "save_weights_external"
    SAMPLE = "sample"

    @property
    def changes_model(self) -> bool:
        """Requests whose effect lives in the model's state (replayed after a worker restart)."""
        return self in (RequestKind.CREATE_MODEL, RequestKind.LOAD_WEIGHTS, RequestKind.FORWARD_BACKWARD,
                        RequestKind.OPTIM_STEP)


class RequestState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class JobState(str, enum.Enum):
    QUEUED = "queued"
    STARTING = "starting"
    """Claimed by a worker, which is taking a slot and copying its inputs; no process yet."""
    RUNNING = "running"
    """Its `lockstep run` process exists (the wall-clock cap counts from its start)."""
    PREEMPTING = "preempting"
    """Asked to checkpoint and stop; goes back to QUEUED, and later resumes from the checkpoint."""
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


JOB_TRANSITIONS: dict[JobState, tuple[JobState, ...]] = {
    JobState.QUEUED: (JobState.STARTING, JobState.CANCELLED, JobState.FAILED),
    JobState.STARTING: (JobState.RUNNING, JobState.QUEUED, JobState.FAILED, JobState.CANCELLING),
    JobState.RUNNING: (JobState.SUCCEEDED, JobState.FAILED, JobState.QUEUED, JobState.PREEMPTING,
                       JobState.CANCELLING),
    JobState.PREEMPTING: (JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLING),
    JobState.CANCELLING: (JobState.CANCELLED, JobState.SUCCEEDED, JobState.FAILED),
    JobState.SUCCEEDED: (),
    JobState.FAILED: (),
    JobState.CANCELLED: (),
}
"""STARTING -> QUEUED or RUNNING -> QUEUED is a failed attempt with retries left (after a
backoff), a finished preemption or an attempt its worker's stop or death interrupted; QUEUED ->
FAILED a stored spec the worker's policy refuses; a cancel of a STARTING or RUNNING job goes
through CANCELLING (the scheduler stops the launch or the process); a job only ever ends in a
terminal state."""


class Priority(str, enum.Enum):
    RESERVED = "reserved"
    """May preempt preemptible jobs when capacity is full."""
    PREEMPTIBLE = "preemptible"


@dataclass(frozen=True)
class BatchMember:
    """One request of a packed batch, as the engine host runs it (EngineHost.run_batch)."""

    key: str
    """The model id (forward, forward_backward) or sampling session id (sample) it runs on."""
    payload: Any
    """The request's body: a ForwardBackwardRequest's bytes, or a sample's JSON object."""


class UsageKind(str, enum.Enum):
    COMPUTE_SECONDS = "compute_seconds"
    TOKENS_TRAINED = "tokens_trained"
    TOKENS_SAMPLED = "tokens_sampled"


BUILTIN_MODEL = "lockstep/tiny"
"""The base-model name under which the built-in tiny model is always registered."""


SUPPORTED_LOSSES = LOSSES
"""The engine's built-in losses and their config keys: the config layer's one torch-free list."""


def check_loss(name: str, config: dict) -> None:
    """The config layer's loss check (name, config keys, finite numbers), as a 400."""
    try:
        _check_loss(name, config)
    except ConfigError as e:
        raise ServiceError(str(e)) from None


WORKER_LEASE_S = 15.0
"""A worker whose executor has not renewed its endpoint's last_seen for this long is dead: its
claims are requeued and /v1/health stops counting it (renewed every couple of seconds)."""


@dataclass(frozen=True)
class WorkerConfig:
    """A worker's settings (`lockstep worker` / `lockstep serve` options); the supervisor hands
    them to its Executor."""

    db_url: str
    storage_url: str
    home: str
    """Local working directory (fetch cache, temp files)."""
    ray_address: str = ""
    """Join this Ray cluster; empty: start a loopback-only one on this machine."""
    models: dict = field(default_factory=dict)
    """Extra base models: name -> local Hugging Face directory."""
    threads: int = 0
    """Torch threads of the engine host (0: every core)."""
    persist_every: int = 1
    """Optimizer steps between durable model states (0: never; recovery then replays from creation)."""
    job_slots: int = 1
    """Jobs this worker's Ray node runs at once (the `lockstep_job_slots` resource)."""
    job_memory: str = "auto"
    """How each job's memory is capped (the policy's max_job_memory_mb): "auto" (a cgroup of its own
    where this worker's cgroup allows one, else RLIMIT_AS per process), "cgroup" (refuse to start
    without one) or "rlimit" (see lockstep/memlimit.py)."""
    idle_poll_s: float = 0.25
    max_attempts: int = 3
    """Executor deaths a request may cause before it is failed instead of requeued."""
    max_models: int = 16
    """Trainers held in memory at once (a count, besides model_cache_bytes); the least recently used
    beyond it is spilled to local disk and rebuilt exactly on its next request."""
    max_batch_tokens: int = 65_536
    """Token budget of one packed batch (service/packing.py): forward, forward_backward or sample
    requests of one base model, from any tenants, run together up to it (a request larger than it
    runs alone). Default: the API's max_tokens_per_request."""
    max_sessions: int = 32
    """Sampling sessions held in memory, likewise (one beyond it is reopened from its saved weights)."""
    model_cache_bytes: int = 0
    """Bytes of tensors the engine host holds (shared bases, adapters with their gradients and AdamW
    moments, full trainers, sampler weights); the least recently used beyond it are evicted. 0: half
    the machine's memory (three quarters of the GPU's with --device cuda)."""
    fetch_cache_bytes: int = 4 << 30
    """Local copies of saved states kept for reuse (least recently used evicted beyond it)."""
    janitor_every_s: float = 30.0
    """How often expired checkpoints and abandoned sessions' sampler snapshots are deleted."""
    device: str = "cpu"
    """Where the engine host computes: "cpu", or "cuda" (the Triton kernels; the executor then takes
    a GPU from Ray)."""
    dtype: str = "float32"
    """"float32", or "bfloat16" (needs device "cuda")."""
    speculative: str = "off"
    """Speculative decoding in sampling sessions: a drafter name ("suffix", "model") or "off"; each session
    gets its own drafter and decides per step whether speculating pays (outputs never change)."""
    draft_tokens: int = 4
    """Tokens drafted per row and decode step, at most."""
    draft_timeout_s: float = 10.0
    """A drafter call past this is abandoned (that request decodes on plainly; the next starts the
    drafter afresh)."""
    session_ttl_s: float = 86400.0
    """A session's ephemeral sampler snapshots are deleted this long after its last heartbeat (or
    once it is finished)."""
