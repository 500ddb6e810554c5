"""Data-parallel training that is bit for bit one process accumulating the same micro-batches.

One process running `forward_backward` on micro-batches 0, 1, ..., M-1 and then `optim_step`
accumulates gradients as ((g0 + g1) + g2) + ...: autograd adds each backward's gradient into
`.grad` in call order. Floating-point addition is not associative, so a data-parallel step that
sums per-rank partial sums (an all-reduce) gives different bits, and different bits again for
another number of ranks. Here every rank computes its own contiguous range of micro-batches, then
the sum is *chained* in micro-batch order: rank 0 adds its gradients in order and sends the running
sum to rank 1, which adds its own in order, and so on; the last rank broadcasts the total. The
reduction order is therefore the one-process order, whatever the number of ranks, and every rank
then takes the same optimizer step on the same gradients, so all ranks hold identical weights
(one of them publishes, one checkpoint is the run's; it resumes under any number of ranks).

Cost: each rank keeps its own micro-batches' gradients until the running sum reaches it (k x P
floats for k micro-batches of a P-parameter model), and the chain is N - 1 sends of P floats plus a
broadcast, sequential in N (the adds are cheap next to the backward passes they follow). The
all-reduce it replaces is faster at large N; exactness is the point here.

The processes form a torch.distributed group (gloo on CPU, NCCL where GPUs are) created by the
caller (`init_group`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from lockstep.engine.trainer import Trainer
from lockstep.engine.types import AdamParams, Datum, EngineError, ForwardBackwardOutput


def init_group(rank: int, world: int, address: str, port: int, *, timeout_s: float = 300.0,
               device: str = "cpu") -> None:
    """Join the process group of `world` ranks whose rank 0 listens on address:port (gloo on CPU,
    NCCL for trainers on GPUs: each rank then uses the GPU it was given)."""
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def shares(micro_batches: int, world: int) -> list[range]:
    """Contiguous, balanced ranges of micro-batch indices, one per rank (earlier ranks take the
    remainder); a rank may get none."""
    base, extra = divmod(micro_batches, world)
    out, start = [], 0
    for r in range(world):
        n = base + (r < extra)
        out.append(range(start, start + n))
        start += n
    return out


class DataParallel:
    """One rank's view of a data-parallel trainer; call the same methods on every rank."""

    def __init__(self, trainer: Trainer, *, rank: int | None = None, world: int | None = None):
        self.trainer = trainer
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        self.params = list(trainer.params.values())
        self.sizes = [p.numel() for p in self.params]
        self.device = self.params[0].device
        """Where the chain's buffers live (NCCL sends GPU tensors)."""

    # -- gradients ----------------------------------------------------------------------------
    def forward_backward(self, micro_batches: Sequence[Sequence[Datum]], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> list[ForwardBackwardOutput]:
        """Gradients of every micro-batch, summed in micro-batch order into every rank's `.grad`.
        Returns the outputs of this rank's own micro-batches (in order).

        A micro-batch that fails, with any exception, fails the step on every rank at once: the
        failing rank still takes its part in the chain, flagged, then raises its own error; the
        others raise EngineError (the failure was a user mistake) or PeerFailed, naming the rank
        and micro-batch. Leaving the chain instead would keep the others waiting for its sum until
        the group's timeout (300 s). No rank applies any gradient."""
        if any(p.grad is not None for p in self.params):
            raise EngineError("data-parallel forward_backward needs cleared gradients (call optim_step or zero_grad first)")
        mine = shares(len(micro_batches), self.world)[self.rank]
        outputs, grads, failure = [], [], None
        for m in mine:
            try:
                outputs.append(self.trainer.forward_backward(micro_batches[m], loss_fn, loss_fn_config))
                grads.append([None if p.grad is None else p.grad.detach().clone() for p in self.params])
            except Exception as e:  # noqa: BLE001 - re-raised below, once every rank knows
                failure = Failure(m, self.rank, isinstance(e, EngineError), e)
            finally:
                self.trainer.zero_grad()
            if failure is not None:
                break  # the step fails: this rank's later micro-batches would be thrown away
        total, first = self._chain(grads, failure)
        if first is not None:
            raise (failure or first).error(self.world)  # a rank that failed raises its own error
        for p, g in zip(self.params, total):
            p.grad = g
        return outputs

    def optim_step(self, adam: AdamParams = AdamParams()) -> dict[str, float]:
        """The same AdamW step on every rank (same gradients, same state: same weights)."""
        return self.trainer.optim_step(adam)

    # -- the chain ----------------------------------------------------------------------------
    def _chain(self, grads: list[list[torch.Tensor | None]], failure: "Failure | None") -> tuple[list, "Failure | None"]:
        """(the ordered sum of every rank's gradients, the first failure of any rank), on every rank."""
        acc: list[torch.Tensor | None] = [None] * len(self.params)
        if self.rank > 0:
            acc, before = self._recv(self.rank - 1)
            failure = before or failure  # an earlier rank's is the earlier micro-batch
        for g in grads:  # autograd's accumulation, in micro-batch order: None + g = g, else acc + g
            acc = [x if a is None else (a if x is None else a + x) for a, x in zip(acc, g)]
        if self.rank < self.world - 1:
            self._send(acc, failure, self.rank + 1)
        return self._broadcast(acc, failure, src=self.world - 1)

    def _pack(self, acc, failure: "Failure | None") -> tuple[torch.Tensor, torch.Tensor]:
        """(presence of each gradient, then the failure's code; the gradients, flat)."""
        code = failure.code() if failure is not None else [0, 0, 0]
        present = torch.tensor([a is not None for a in acc] + code, dtype=torch.int64, device=self.device)
        flat = torch.cat([(a if a is not None else torch.zeros_like(p)).reshape(-1).to(torch.float32)
                          for a, p in zip(acc, self.params)])
        return present, flat

    def _unpack(self, present: torch.Tensor, flat: torch.Tensor) -> tuple[list[torch.Tensor | None], "Failure | None"]:
        out, offset, flags = [], 0, present.tolist()
        for p, n, has in zip(self.params, self.sizes, flags):
            out.append(flat[offset:offset + n].view_as(p).to(p.dtype).clone() if has else None)
            offset += n
        return out, Failure.decode(flags[len(self.params):])

    def _empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(len(self.params) + 3, dtype=torch.int64, device=self.device),
                torch.zeros(sum(self.sizes), dtype=torch.float32, device=self.device))

    def _send(self, acc, failure, dst: int) -> None:
        present, flat = self._pack(acc, failure)
        dist.send(present, dst)
        dist.send(flat, dst)

    def _recv(self, src: int) -> tuple[list[torch.Tensor | None], "Failure | None"]:
        present, flat = self._empty()
        dist.recv(present, src)
        dist.recv(flat, src)
        return self._unpack(present, flat)

    def _broadcast(self, acc, failure, *, src: int) -> tuple[list[torch.Tensor | None], "Failure | None"]:
        if self.world == 1:
            return acc, failure
        present, flat = self._pack(acc, failure) if self.rank == src else self._empty()
        dist.broadcast(present, src)
        dist.broadcast(flat, src)
        return (acc, failure) if self.rank == src else self._unpack(present, flat)


class PeerFailed(RuntimeError):
    """Another rank's micro-batch failed with an internal error (that rank raised it): this step
    failed on every rank, and no gradient was applied."""


class PeerRefused(EngineError):
    """Another rank's micro-batch was refused as a user mistake (that rank raised the EngineError
    that says what): this step failed on every rank, and no gradient was applied."""


@dataclass(frozen=True)
class Failure:
    """The first micro-batch of a step that failed, as every rank learns it through the chain."""

    micro_batch: int
    rank: int
    user_error: bool
    """It raised EngineError (a user mistake, e.g. a bad datum), not an internal error."""
    exception: BaseException | None = None
    """The exception itself, on the rank that raised it only."""

    def code(self) -> list[int]:
        return [self.micro_batch + 1, self.rank, int(self.user_error)]

    @staticmethod
    def decode(code: list[int]) -> "Failure | None":
        return Failure(code[0] - 1, code[1], bool(code[2])) if code[0] else None

    def error(self, world: int) -> BaseException:
        """What this rank raises: its own exception, or one that names the rank that failed."""
        if self.exception is not None:
            if isinstance(self.exception, EngineError):
                return EngineError(f"micro-batch {self.micro_batch}: {self.exception}")
            return self.exception
        where = f"micro-batch {self.micro_batch} failed on rank {self.rank} of {world}"
        if self.user_error:
            return PeerRefused(f"{where} (see its error); gradients were not applied")
        return PeerFailed(f"{where} with an internal error (raised there); gradients were not applied")


def micro_split(data: Sequence, micro_batches: int) -> list[list]:
    """A step's datums cut into `micro_batches` contiguous, balanced parts (empty ones dropped)."""
    return [list(data[r.start:r.stop]) for r in shares(len(data), micro_batches) if len(r)]


def merge_metrics(parts: Sequence[tuple[Mapping[str, float], float]]) -> dict[str, float]:
    """Metrics of micro-batches, merged in order by their reduction suffix: `:sum` adds, `:max` /
    `:min` take the extreme, anything else (`:mean`) is the mean weighted by each part's weight
    (its loss tokens)."""
    out: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics, weight in parts:
        for key, value in metrics.items():
            kind = key.rsplit(":", 1)[-1]
            if key not in out:
                out[key], weights[key] = (value * weight if kind not in ("sum", "max", "min") else value), weight
            elif kind == "sum":
                out[key] += value
            elif kind == "max":
                out[key] = max(out[key], value)
            elif kind == "min":
                out[key] = min(out[key], value)
            else:
                out[key] += value * weight
                weights[key] += weight
    for key in out:
        if key.rsplit(":", 1)[-1] not in ("sum", "max", "min"):
            out[key] = out[key] / weights[key] if weights[key] else float("nan")
    return out
