"""The cost model: FLOPs, bytes and messages of a trainer step and of a generator's rollouts.

Conventions (one set for every device and every validation row; docs/planner.md):
- A token's forward costs 2 FLOPs per weight of a matrix product plus causal attention, 2 x ctx x
  hidden for QK^T and PV over on average half the sequence; backward costs twice the forward; full
  recomputation runs the forward once more.
- Matrix products reach `MATMUL_EFFICIENCY` of a GPU's dense peak; a CPU device carries its own
  measured rate (calibrate.py), so its efficiency is 1.
- Element-wise work (norms, activations, residual adds, RoPE) is bound by memory bandwidth: it moves
  the activation bytes a layer stores (Korthikanti et al. 2022, "Reducing Activation Recomputation
  in Large Transformer Models", sec. 4: 34 x s x b x h bytes at 2-byte precision for a GPT layer)
  once in the forward and twice in the backward.
- Collectives are ring algorithms: an all-reduce of S bytes over n devices sends 2 (n-1)/n x S per
  device, at `COMM_EFFICIENCY` of the link (NVLink inside a node, the NIC across nodes).
- Pipeline bubbles follow 1F1B: (p - 1) / v stage-times of idle per step with v virtual stages.
"""

from __future__ import annotations

import math

from lockstep.planner.types import Device, GenerateCost, Memory, ModelShape, TrainCost, TrainLayout, Workload

MATMUL_EFFICIENCY = 0.60
"""Fraction of a GPU's dense peak that a transformer layer's matrix products reach. One round
constant for every GPU kind and model (docs/planner.md shows the rows it is checked against)."""
COMM_EFFICIENCY = 0.75
"""Fraction of a link's datasheet bandwidth that NCCL's ring collectives reach."""
MEMORY_EFFICIENCY = 0.80
"""Fraction of a GPU's datasheet HBM bandwidth that streaming kernels reach."""
ADAM_BYTES = 16
"""Bytes one AdamW update moves per trainable parameter beyond the weight itself: read the grad,
read and write both moments (fp32)."""


def _eff(device: Device, value: float) -> float:
    return value if device.kind == "gpu" else 1.0


def matmul_rate(device: Device) -> float:
    return device.flops * _eff(device, MATMUL_EFFICIENCY)


def decode_rate(device: Device) -> float:
    return device.decode_flops or matmul_rate(device)


def memory_rate(device: Device) -> float:
    return device.memory_bw * _eff(device, MEMORY_EFFICIENCY)


def link(device: Device, group: int, stride: int) -> float:
    """Bandwidth of a collective over `group` devices `stride` apart (NVLink if within a node)."""
    fast = device.link_bw if group * stride <= device.per_node else device.network_bw
    return fast * _eff(device, COMM_EFFICIENCY)


def all_reduce_s(nbytes: float, group: int, bandwidth: float) -> float:
    return 0.0 if group <= 1 else 2 * (group - 1) / group * nbytes / bandwidth


def forward_flops_per_token(shape: ModelShape, ctx: float, *, layers: float | None = None,
                            head: bool = True) -> float:
    """Forward FLOPs of one token that attends to `ctx` earlier tokens (causal)."""
    return (product_flops_per_token(shape, layers=layers, head=head)
            + attention_flops_per_token(shape, ctx, layers=layers))


def product_flops_per_token(shape: ModelShape, *, layers: float | None = None, head: bool = True) -> float:
    layers = shape.num_layers if layers is None else layers
    return layers * 2 * shape.layer_matmul_params + (2 * shape.vocab * shape.hidden if head else 0.0)


def attention_flops_per_token(shape: ModelShape, ctx: float, *, layers: float | None = None) -> float:
    """QK^T and PV: 2 x 2 x ctx x hidden per layer."""
    layers = shape.num_layers if layers is None else layers
    return layers * 4 * ctx * shape.hidden


def forward_s(shape: ModelShape, device: Device, tokens: float, ctx: float, *, rate: float,
              layers: float | None = None, head: bool = True) -> float:
    """Seconds of the forward's FLOPs for `tokens` tokens: products at `rate`, attention at the
    device's attention rate."""
    attention_rate = device.attention_flops or rate
    return tokens * (product_flops_per_token(shape, layers=layers, head=head) / rate
                     + attention_flops_per_token(shape, ctx, layers=layers) / attention_rate)


def activation_bytes_per_token(shape: ModelShape, device: Device) -> float:
    """Bytes one layer keeps per token for its backward, with flash attention (no s^2 term): the
    layer input, both norms' outputs, q, k, v, the attention output, the residual in between (7h
    with k and v at their GQA width), and the MLP's matrices' outputs (gate, up and their product:
    3I; GELU: 2I). For GPT's 4h GELU MLP that is 17h elements, Korthikanti et al.'s 34h bytes."""
    kv = shape.num_kv_heads * shape.head_dim
    elements = 5 * shape.hidden + 2 * kv + (3 if shape.gated_mlp else 2) * shape.intermediate
    return elements * device.bytes_per_param


# --- trainer ---------------------------------------------------------------------------------------

def trainer_memory(shape: ModelShape, work: Workload, device: Device, layout: TrainLayout) -> Memory:
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    layers_per_stage = math.ceil(shape.num_layers / pp)
    embed = shape.vocab * shape.hidden
    stage_params = layers_per_stage * (shape.layer_matmul_params + 2 * shape.hidden) + embed
    weights = stage_params / tp * device.bytes_per_param
    trainable = shape.trainable_params * stage_params / shape.params if shape.lora_rank else stage_params
    trainable_dev = trainable / tp
    mixed = device.bytes_per_param < 4
    shard = dp if layout.zero else 1
    grads = trainable_dev * 4 / shard  # fp32 gradients (main grads under mixed precision)
    optimizer = trainable_dev * (12 if mixed else 8) / shard  # (fp32 master +) m + v
    tokens_mb = layout.micro_batch * work.trained_tokens_per_sequence
    per_token = activation_bytes_per_token(shape, device) / tp
    if layout.recompute == "full":
        kept = layers_per_stage * 2 * shape.hidden * device.bytes_per_param / tp + per_token
    else:
        kept = layers_per_stage * per_token
    micro = math.ceil(work.sequences / dp / layout.micro_batch)
    in_flight = min(micro, pp) * ((1 + (pp - 1) / (pp * layout.interleave)) if layout.interleave > 1 else 1)
    logits = tokens_mb * shape.vocab * 4 / tp  # fp32 logits of one micro-batch for the loss
    return Memory(weights=weights, grads=grads, optimizer=optimizer,
                  activations=in_flight * tokens_mb * kept + logits)


def trainer_step(shape: ModelShape, work: Workload, device: Device, layout: TrainLayout) -> TrainCost:
    """Predicted time of one optimizer step on `layout.devices` devices."""
    tp, pp, dp, v = layout.tp, layout.pp, layout.dp, layout.interleave
    seqs_per_rank = work.sequences / dp
    micro = math.ceil(seqs_per_rank / layout.micro_batch)
    tokens_mb = layout.micro_batch * work.trained_tokens_per_sequence
    layers = shape.num_layers / pp
    # The last stage also runs the output head; the slowest stage sets the pace.
    fwd_s = forward_s(shape, device, tokens_mb / tp, work.seq_len / 2, rate=matmul_rate(device), layers=layers)
    passes = 4 if layout.recompute == "full" else 3  # forward, backward (x2), recompute
    elementwise = (passes * tokens_mb * layers * activation_bytes_per_token(shape, device) / tp
                   / memory_rate(device))
    stage_mb = (passes * fwd_s + elementwise + device.overheads.train_batch
                + tokens_mb * device.overheads.train_token)
    act_msg = tokens_mb * shape.hidden * device.bytes_per_param
    tp_calls = (6 if layout.recompute == "full" else 4) * layers  # all-reduces per micro-batch per stage
    tp_mb = tp_calls * all_reduce_s(act_msg, tp, link(device, tp, 1))
    pp_mb = (2 * v * (act_msg / tp) / link(device, 2, tp * dp) if pp > 1 else 0.0)
    per_mb = stage_mb + tp_mb + pp_mb
    bubble = (pp - 1) / v * per_mb
    trainable = shape.trainable_params / (tp * pp)
    dp_comm = all_reduce_s(trainable * 4, dp, link(device, dp, tp * pp))
    optimizer = trainable * (ADAM_BYTES + 2 * device.bytes_per_param) / (dp if layout.zero else 1) / memory_rate(device)
    step = micro * per_mb + bubble + dp_comm + optimizer
    return TrainCost(step_s=step, compute_s=micro * stage_mb, bubble_s=bubble, tp_comm_s=micro * tp_mb,
                     pp_comm_s=micro * pp_mb, dp_comm_s=dp_comm, optimizer_s=optimizer,
                     memory=trainer_memory(shape, work, device, layout))


# --- generator -------------------------------------------------------------------------------------

def generator_memory(shape: ModelShape, work: Workload, device: Device, tp: int, rows: int) -> Memory:
    weights = shape.params * device.bytes_per_param / tp
    kv = rows * work.seq_len * shape.kv_elements_per_token * device.bytes_per_param / tp
    return Memory(weights=weights, kv_cache=kv)


def max_rows(shape: ModelShape, work: Workload, device: Device, tp: int) -> int:
    """Sequences one replica can hold in its KV cache at once (0: the weights alone do not fit)."""
    free = device.memory - shape.params * device.bytes_per_param / tp
    per_row = work.seq_len * shape.kv_elements_per_token * device.bytes_per_param / tp
    return max(0, int(free // per_row))


def decode_step_s(shape: ModelShape, device: Device, tp: int, rows: int, ctx: float) -> float:
    """One decode step of `rows` sequences at context `ctx`: the larger of compute and memory
    (weights plus the KV cache read once), plus the tensor-parallel all-reduces and call overhead."""
    compute = forward_s(shape, device, rows / tp, ctx, rate=decode_rate(device))
    memory = (shape.params * device.bytes_per_param
              + rows * ctx * shape.kv_elements_per_token * device.bytes_per_param) / tp / memory_rate(device)
    comm = 2 * shape.num_layers * all_reduce_s(rows * shape.hidden * device.bytes_per_param, tp, link(device, tp, 1))
    o = device.overheads
    return max(compute, memory) + comm + o.decode_step + rows * o.decode_row


def generate_batch(shape: ModelShape, work: Workload, device: Device, tp: int, rows: int) -> GenerateCost:
    """Prefill then decode of `rows` sequences on one replica; rows beyond what the KV cache holds
    run in later waves."""
    cap = max_rows(shape, work, device, tp)
    assert cap >= 1, "caller checks that the weights and one row fit"
    waves, wave_rows = math.ceil(rows / cap), min(rows, cap)
    # A group's prompt is prefilled once (the sampler shares it across the group's samples).
    prompts = wave_rows / work.group_size if work.prompt_tokens >= 4 else wave_rows
    prefill = forward_s(shape, device, prompts * work.prompt_tokens / tp, work.prompt_tokens / 2,
                        rate=matmul_rate(device))
    decode = _decode_s(shape, work, device, tp, wave_rows)
    batch = waves * (prefill + decode)
    tokens = rows * work.completion_tokens
    return GenerateCost(batch_s=batch, prefill_s=waves * prefill, decode_s=waves * decode, rows=wave_rows,
                        memory=generator_memory(shape, work, device, tp, wave_rows),
                        tokens_per_s=tokens / batch if batch > 0 else 0.0)


def _decode_s(shape: ModelShape, work: Workload, device: Device, tp: int, rows: int) -> float:
    """Sum of decode steps, evaluated at up to 64 context midpoints (each term is linear in ctx
    within a segment, so the sum is exact unless compute and memory cross inside one)."""
    steps = work.completion_tokens
    if steps == 0:
        return 0.0
    segments = min(steps, 64)
    total = 0.0
    for i in range(segments):
        lo, hi = steps * i // segments, steps * (i + 1) // segments
        total += (hi - lo) * decode_step_s(shape, device, tp, rows, work.prompt_tokens + (lo + hi) / 2)
    return total


def weight_sync_s(shape: ModelShape, device: Device, generator_tp: int) -> float:
    """New weights from the trainer to a generator replica: each of the replica's devices receives
    its shard across the network (a pipelined broadcast: the bytes about once per link)."""
    bandwidth = device.sync_bw or device.network_bw * _eff(device, COMM_EFFICIENCY)
    return device.sync_latency + shape.params * device.bytes_per_param / generator_tp / bandwidth
