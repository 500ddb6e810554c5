"""The planner's contract: what it is asked (model, workload, cluster) and what it answers.

Everything here is torch-free and frozen. Sizes are in bytes, rates in per-second units, times in
seconds; a table or a message converts to GiB and ms at the edge.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

GIB = 1024**3


class PlanRefused(ValueError):
    """No strategy can run this: the message names the resource (memory, devices) and what to change."""

    def __init__(self, resource: str, message: str, *, need: float = 0.0):
        super().__init__(message if message.startswith(resource) else f"{resource}: {message}")
        self.resource = resource
        """The resource that does not suffice, e.g. "trainer memory" or "rollout.replicas"."""
        self.need = need
        """How much of it was needed (bytes per device, for memory), to pick the closest miss."""


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder-only transformer, as far as cost and memory go."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = True
    gated_mlp: bool = True
    """SwiGLU-style MLP (gate, up, down: three matrices) rather than two (GPT's GELU MLP)."""
    lora_rank: int = 0
    """> 0: only LoRA adapters of this rank train (frozen base weights need no grads or Adam state)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "intermediate", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model shape {self.name!r}: {name} must be an integer >= 1, got {value!r}")
        if self.hidden % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"model shape {self.name!r}: hidden ({self.hidden}) must divide by num_heads "
                             f"({self.num_heads}) and num_heads by num_kv_heads ({self.num_kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's matrix products: q, o (h x h), k, v (h x kv), the MLP's matrices."""
        kv = self.num_kv_heads * self.head_dim
        return 2 * self.hidden * self.hidden + 2 * self.hidden * kv + (3 if self.gated_mlp else 2) * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        """Every weight that takes part in a product per token: the layers and the output head
        (counted even when tied to the embedding, since the product happens)."""
        return self.num_layers * self.layer_matmul_params + self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Stored parameters: layers (with their two norms), embedding, head unless tied, final norm."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.num_layers * (self.layer_matmul_params + 2 * self.hidden) + self.vocab * self.hidden + head + self.hidden

    @property
    def trainable_params(self) -> int:
        if not self.lora_rank:
            return self.params
        kv = self.num_kv_heads * self.head_dim
        # A rank-r adapter on each projection: r x (in + out) per matrix.
        per_layer = self.lora_rank * (2 * (2 * self.hidden) + 2 * (self.hidden + kv)
                                      + (3 if self.gated_mlp else 2) * (self.hidden + self.intermediate))
        return self.num_layers * per_layer

    @property
    def kv_elements_per_token(self) -> int:
        """Keys and values cached per token, over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class Workload:
    """One optimizer step of the RL loop (or of SFT, with no generation)."""

    kind: Literal["rl", "sft"]
    sequences: int
    """Sequences per optimizer step (prompts_per_step x group_size, or the SFT batch)."""
    prompt_tokens: int
    completion_tokens: int
    """Tokens sampled per sequence (the whole budget: the planner plans for the longest rollout)."""
    group_size: int = 1
    max_staleness: int = 0
    """How many policy versions a batch may lag; max_staleness + 1 batches are in flight."""
    zero_variance: float = 0.0
    """Share of prompt groups whose samples all get the same reward (no signal): the runtime draws
    more rollout batches until `prompts_per_step` groups with signal are in (planner/loop.py). It
    depends on the policy and the data, so it is an input (a run logs it: filter/zero_variance)."""
    env_episode_s: float = 0.0
    """Env work per episode (its calls and reward) in the env worker, measured for a CPU plan."""

    def __post_init__(self) -> None:
        for name in ("sequences", "prompt_tokens", "group_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"workload: {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.completion_tokens, int) or self.completion_tokens < 0:
            raise ValueError(f"workload: completion_tokens must be an integer >= 0, got {self.completion_tokens!r}")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"workload: max_staleness must be an integer >= 0, got {self.max_staleness!r}")
        if not 0.0 <= self.zero_variance < 1.0:
            raise ValueError(f"workload: zero_variance must be in [0, 1), got {self.zero_variance!r}")

    @property
    def trained_tokens_per_sequence(self) -> float:
        """Tokens the trainer computes per sequence: a group's shared prompt runs once (the engine's
        prefix sharing, engine/prefix.py, for prompts of 4 tokens or more)."""
        if self.group_size > 1 and self.prompt_tokens >= 4:
            return self.prompt_tokens / self.group_size + self.completion_tokens
        return self.seq_len

    @property
    def seq_len(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len


@dataclass(frozen=True)
class Overheads:
    """Fixed costs of the engine, linear in what they scale with (calibrate.py measures them)."""

    decode_step: float = 0.0
    """Seconds per decode step whatever the rows: the sampler loop's Python and kernel dispatch."""
    decode_row: float = 0.0
    """Seconds per row per decode step: log-softmax, the draw, stop checks, attention's fixed part."""
    train_batch: float = 0.0
    """Seconds per micro-batch: autograd's dispatch of every op, the optimizer's loop."""
    train_token: float = 0.0
    """Seconds per token: the loss, log-softmax and element-wise kernels' fixed part per row."""


@dataclass(frozen=True)
class Device:
    """One accelerator (or, for a CPU, one core); rates are dense peaks at the training precision."""

    name: str
    kind: Literal["gpu", "cpu"]
    flops: float
    """Dense matrix-product FLOP/s (bf16 tensor cores for a GPU; measured fp32 sgemm for a CPU core)."""
    memory: float
    """Bytes of device memory (HBM; for CPU cores, the share of RAM the run may use)."""
    memory_bw: float
    """Bytes/s of device memory bandwidth."""
    link_bw: float
    """Bytes/s one device sends to a peer in its node (NVLink; for CPU cores, memory-to-memory)."""
    network_bw: float
    """Bytes/s one device sends across nodes (InfiniBand/RoCE NIC share)."""
    per_node: int = 8
    """Devices sharing the fast link (one NVLink domain)."""
    bytes_per_param: int = 2
    """Weights and activations as stored: 2 for bf16 on GPUs, 4 for the CPU engine's fp32."""
    overheads: "Overheads" = field(default_factory=lambda: Overheads())
    """The engine's time beyond products and memory traffic; measured on a CPU, zero for GPUs (where
    kernel launches are not modelled)."""
    sync_bw: float = 0.0
    """Bytes/s of moving new weights from the trainer to a generator (0: `network_bw`)."""
    sync_latency: float = 0.0
    """Seconds of fixed cost per weight sync (publishing, the swap)."""
    attention_flops: float = 0.0
    """Rate of attention's score and value FLOPs (0: `flops`, as flash attention nearly reaches on a
    GPU); a CPU's attention kernel is not a product and runs at its own measured rate."""
    decode_flops: float = 0.0
    """A CPU's product rate at the sampler's row count (0: `flops`); small products run slower."""
    source: str = ""
    """Where the numbers come from (a datasheet, or this machine's calibration)."""


@dataclass(frozen=True)
class Cluster:
    device: Device
    count: int
    """Devices in the cluster (GPUs, or CPU cores)."""

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 1:
            raise PlanRefused("devices", f"a cluster needs at least 1 device, got {self.count!r} "
                                         f"(pass --gpus KIND:COUNT with COUNT >= 1, or --cpus N >= 1)")


@dataclass(frozen=True)
class TrainLayout:
    """How the trainer is cut over its devices."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch: int = 1
    """Sequences per micro-batch on each data-parallel rank."""
    interleave: int = 1
    """Virtual pipeline stages per device (Megatron's interleaved 1F1B); 1 = plain 1F1B."""
    recompute: Literal["none", "full"] = "none"
    """Activation recomputation: "full" keeps only each layer's input and runs the forward twice."""
    zero: bool = True
    """Gradients, optimizer states and fp32 master weights sharded over the data-parallel ranks
    (ZeRO-2, as FSDP and Megatron's distributed optimizer do); the bf16 weights stay whole."""

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp


def _gib(nbytes: float) -> str:
    gib = nbytes / GIB
    return f"{gib:,.0f}" if gib >= 100 else f"{gib:.1f}" if gib >= 1 else f"{gib:.3g}"


@dataclass(frozen=True)
class Memory:
    """Bytes per device, by what holds them."""

    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.kv_cache

    def describe(self) -> str:
        parts = [f"{name} {_gib(getattr(self, name))}" for name in ("weights", "grads", "optimizer", "activations",
                                                                    "kv_cache") if getattr(self, name)]
        return ", ".join(parts)

    def as_gib(self) -> dict:
        out = {k: round(v / GIB, 4) for k, v in asdict(self).items()}
        out["total"] = round(self.total / GIB, 4)
        return out


@dataclass(frozen=True)
class TrainCost:
    """The trainer's predicted step, split by cause."""

    step_s: float
    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    optimizer_s: float
    memory: Memory


@dataclass(frozen=True)
class GenerateCost:
    """One generator replica's predicted time for its share of a step's rollouts."""

    batch_s: float
    prefill_s: float
    decode_s: float
    rows: int
    """Sequences this replica decodes at once."""
    memory: Memory
    tokens_per_s: float


@dataclass(frozen=True)
class Simulation:
    """The async RL loop's steady state (simulate.py)."""

    step_s: float
    generator_busy: float
    trainer_busy: float
    mean_staleness: float
    sync_s: float


@dataclass(frozen=True)
class Strategy:
    """The planner's answer: the fastest strategy that fits, with its predictions."""

    device: str
    devices: int
    generator_devices: int
    trainer_devices: int
    generator_replicas: int
    generator_tp: int
    trainer: TrainLayout
    max_staleness: int
    step_s: float
    train: TrainCost
    generate: GenerateCost | None
    simulation: Simulation | None
    considered: int = 0
    """Strategies evaluated; those refused for memory are counted in `refused`."""
    refused: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        out = {
            "device": self.device, "devices": self.devices, "generator_devices": self.generator_devices,
            "trainer_devices": self.trainer_devices, "generator_replicas": self.generator_replicas,
            "generator_tp": self.generator_tp, "trainer": asdict(self.trainer), "max_staleness": self.max_staleness,
            "step_s": self.step_s,
            "train": {k: v for k, v in asdict(self.train).items() if k != "memory"},
            "trainer_memory_gib": self.train.memory.as_gib(),
            "considered": self.considered, "refused": self.refused, "notes": list(self.notes),
        }
        if self.generate is not None:
            out["generate"] = {k: v for k, v in asdict(self.generate).items() if k != "memory"}
            out["generator_memory_gib"] = self.generate.memory.as_gib()
        if self.simulation is not None:
            out["simulation"] = asdict(self.simulation)
        return out
