"""Colocated engines over the ranks of a torchrun world: which ranks share an engine, each
engine's seed, and how the ranks of a shared engine pool their prompts.

Every training rank runs a colocated engine, or `tensor_parallel_size` consecutive ranks share one
engine sharded over their devices (a tensor-parallel group: ranks [0, tp), [tp, 2 tp), ...). The
ranks of a group run identical engines in lock step (vLLM's `external_launcher` executor: each
rank schedules the same requests and computes its shard), so every rank of a group must call
`generate` with the same requests: each rank gathers the group's prompts, the group generates
them once, and each rank keeps the completions of its own prompts. Groups differ in seed, so
their unseeded samples differ; the ranks of one group share a seed, as lock step needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as torch_dist

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ColocateLayout:
    """This rank's place among the colocated engines of a run."""

    rank: int = 0
    """Global rank, 0 .. world_size - 1."""
    world_size: int = 1
    """Training processes over all nodes."""
    tensor_parallel_size: int = 1
    """Ranks (devices) per engine."""

    def __post_init__(self) -> None:
        tp, world_size = self.tensor_parallel_size, self.world_size
        if tp < 1:
            raise ValueError(f"vllm_tensor_parallel_size must be >= 1, got {tp}")
        if world_size % tp:
            divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
            raise ValueError(
                f"vllm_tensor_parallel_size={tp} does not divide the {world_size} training process(es): "
                f"each colocated vLLM engine spans vllm_tensor_parallel_size ranks, so set it to one of "
                f"{divisors}, or launch a multiple of {tp} processes (NPROC_PER_NODE x NNODES)"
            )
        if not 0 <= self.rank < world_size:
            raise ValueError(f"rank {self.rank} is outside 0 .. {world_size - 1}")

    @property
    def num_engines(self) -> int:
        """Engines over the whole world."""
        return self.world_size // self.tensor_parallel_size

    @property
    def engine_index(self) -> int:
        """Which engine (tensor-parallel group) this rank belongs to."""
        return self.rank // self.tensor_parallel_size

    @property
    def rank_in_group(self) -> int:
        """This rank's place within its group, 0 .. tensor_parallel_size - 1."""
        return self.rank % self.tensor_parallel_size

    def group_ranks(self) -> list[list[int]]:
        """The global ranks of every group, in order."""
        tp = self.tensor_parallel_size
        return [list(range(start, start + tp)) for start in range(0, self.world_size, tp)]

    def engine_seed(self, seed: int) -> int:
        """The seed of this rank's engine: the run's seed plus the engine's index."""
        return seed + self.engine_index


def merge_shares(shares: Sequence[Sequence[T]]) -> tuple[list[T], list[int]]:
    """The group's requests, rank after rank, and how many each rank gave."""
    return [item for share in shares for item in share], [len(share) for share in shares]


def own_share(outputs: Sequence[T], sizes: Sequence[int], rank_in_group: int) -> list[T]:
    """The outputs of the `rank_in_group`-th rank's requests, out of the group's in `merge_shares`
    order (`sizes`: requests per rank)."""
    if len(outputs) != sum(sizes):
        raise ValueError(f"got {len(outputs)} outputs for {sum(sizes)} requests of the group")
    start = sum(sizes[:rank_in_group])
    return list(outputs[start : start + sizes[rank_in_group]])


class EngineGroup:
    """The ranks sharing this rank's engine, and the gather of what each brings to a call.

    With several ranks per engine the constructor builds one gloo process group per engine (the
    requests are small Python objects); every rank of the world must construct it, in the same
    order relative to other group creations.
    """

    def __init__(self, layout: ColocateLayout) -> None:
        self.layout = layout
        self._group = None
        if layout.tensor_parallel_size > 1:
            self._group, _ = torch_dist.new_subgroups_by_enumeration(layout.group_ranks(), backend="gloo")

    @property
    def size(self) -> int:
        return self.layout.tensor_parallel_size

    def gather(self, value: Any) -> list[Any]:
        """Every group rank's picklable `value`, in rank order (just `[value]` alone)."""
        if self._group is None:
            return [value]
        gathered: list[Any] = [None] * self.size
        torch_dist.all_gather_object(gathered, value, group=self._group)
        return gathered

    def close(self) -> None:
        if self._group is not None and torch_dist.is_initialized():
            torch_dist.destroy_process_group(self._group)
            self._group = None
