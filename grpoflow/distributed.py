"""Data-parallel training over several processes: the few collectives the training loop needs.

Every rank holds a full copy of the policy, rolls out and scores its own slice of the global
generation batch, and runs the update on it. There is no DDP wrapper (the log-prob path calls the
decoder directly): after the backward passes of an optimizer step, `all_reduce_gradients` sums the
gradients of every rank in a few flat buckets, and the losses are normalised by global totals, so
that the summed gradient is the gradient one process would get on the whole global batch.

Under `fsdp` the model is sharded instead (`grpoflow.policy.placement`) and FSDP reduce-scatters the
gradients itself.

A single process gets `DistributedContext()` (world size 1), whose collectives do nothing; the loop
reads the same either way.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

ON_POLICY_TOKENS = tuple(
    f"on_policy/{name}_tokens" for name in ("replaced", "continued", "unchecked", "unconfirmed")
)
"""The token counts of `on_policy_sampling`, summed over ranks (its rounds and seconds: the
slowest rank's)."""
BUCKET_NUMEL = 2**25
"""Gradient elements per all-reduce call (128 MiB in float32)."""
SUM_METRICS = ("rewards/num_errors", "episodes/num_errors", "tokens_per_second/", *ON_POLICY_TOKENS)
"""Metric names (or prefixes) summed over ranks; `MAX_METRICS` and names ending in /max take the
largest, names ending in /min the smallest; others the mean."""
MAX_METRICS = ("time/", "memory/", "on_policy/rounds", "on_policy/seconds")


@dataclass(frozen=True, slots=True)
class DistributedContext:
    """This process's place among the ranks of a run, and the collectives the loop uses."""

    rank: int = 0
    """Global rank, 0 .. world_size - 1."""
    world_size: int = 1
    """Number of processes over all nodes."""
    local_rank: int = 0
    """Rank on this node; the index of this rank's GPU."""
    device: torch.device = torch.device("cpu")
    """Where this rank's collectives exchange tensors (its GPU under NCCL, else the CPU)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs and writes checkpoints."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`tensor` summed (or `max`) over ranks, on `tensor`'s device."""
        if self.world_size == 1:
            return tensor
        reduced = tensor.detach().to(self.device, copy=True)
        torch_dist.all_reduce(reduced, op=_REDUCE_OPS[op])
        return reduced.to(tensor.device)

    def max_int(self, value: int) -> int:
        """The largest `value` over ranks."""
        return int(self.all_reduce(torch.tensor(value, dtype=torch.long), "max"))

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The `tensor` of every rank concatenated along dim 0, in rank order (equal shapes)."""
        if self.world_size == 1:
            return tensor
        local = tensor.detach().contiguous().to(self.device)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        torch_dist.all_gather(parts, local)
        return torch.cat(parts).to(tensor.device)

    def gather_objects(self, value: Any) -> list[Any] | None:
        """Every rank's picklable `value`, in rank order, on rank 0; None on the others."""
        if self.world_size == 1:
            return [value]
        gathered = [None] * self.world_size if self.is_main else None
        torch_dist.gather_object(value, gathered, dst=0)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            torch_dist.barrier()

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Copy rank 0's parameters and buffers into every rank's `module`, in place."""
        if self.world_size == 1:
            return
        for tensor in [*module.parameters(), *module.buffers()]:
            staged = tensor.data.to(self.device)
            torch_dist.broadcast(staged, src=0)
            tensor.data.copy_(staged)

    def all_reduce_gradients(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Sum the gradients of `parameters` over ranks, in flat buckets.

        A parameter with a gradient on some rank but none on this one (not reached by this rank's
        batch) joins with zeros; one without a gradient on any rank keeps none, so the optimizer
        skips it exactly as a single process would.
        """
        if self.world_size == 1:
            return
        present = torch.tensor([p.grad is not None for p in parameters], dtype=torch.long)
        present = self.all_reduce(present, "max").bool().tolist()
        grads = []
        for parameter, anywhere in zip(parameters, present, strict=True):
            if anywhere and parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            if anywhere:
                grads.append(parameter.grad)
        for bucket in _buckets(grads, BUCKET_NUMEL):
            flat = _flatten_dense_tensors(bucket).to(self.device)
            torch_dist.all_reduce(flat)
            for grad, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                grad.copy_(reduced)

    def reduce_metrics(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """Per-rank metrics as one value each: summed, largest or mean over ranks by name."""
        if self.world_size == 1:
            return dict(metrics)
        names = sorted(metrics)
        values = torch.tensor([float(metrics[name]) for name in names], dtype=torch.float64)
        summed = self.all_reduce(values, "sum").tolist()
        # One max-reduction gives both extremes: the max of -x is -min(x).
        extremes = self.all_reduce(torch.cat([values, -values]), "max").tolist()
        largest, smallest_negated = extremes[: len(names)], extremes[len(names) :]
        reduced = {}
        for index, name in enumerate(names):
            if name.startswith(SUM_METRICS):
                reduced[name] = summed[index]
            elif name.startswith(MAX_METRICS) or name.endswith("/max"):
                reduced[name] = largest[index]
            elif name.endswith("/min"):
                reduced[name] = -smallest_negated[index]
            else:
                reduced[name] = summed[index] / self.world_size
        return reduced

    def close(self) -> None:
        if self.world_size > 1 and torch_dist.is_initialized():
            torch_dist.destroy_process_group()


_REDUCE_OPS = {
    "sum": torch_dist.ReduceOp.SUM,
    "max": torch_dist.ReduceOp.MAX,
}


def _buckets(tensors: Iterable[torch.Tensor], max_numel: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of tensors of one dtype and device, each up to `max_numel` elements."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        last = buckets[-1][-1] if buckets else None
        same_kind = last is not None and (last.dtype, last.device) == (tensor.dtype, tensor.device)
        if not same_kind or size + tensor.numel() > max_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += tensor.numel()
    return buckets


def launched_world_size() -> int:
    """The processes torchrun launched for the run (its WORLD_SIZE; 1 without it), known before
    any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: torch.device) -> tuple[DistributedContext, torch.device]:
    """The run's context and this rank's device, initialising the process group under torchrun
    (NCCL on CUDA, each rank on `cuda:LOCAL_RANK`; gloo on the CPU). Outside torchrun, or with one
    process, a single-process context and `device` unchanged."""
    world_size = launched_world_size()
    if world_size == 1:
        return DistributedContext(device=device), device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise ValueError(
                f"LOCAL_RANK {local_rank} needs GPU {local_rank} but this node shows {visible}: "
                f"set NPROC_PER_NODE to at most {visible}"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not torch_dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch_dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    collective_device = device if device.type == "cuda" else torch.device("cpu")
    context = DistributedContext(
        rank=rank, world_size=world_size, local_rank=local_rank, device=collective_device
    )
    return context, device
