"""The experts a mixture-of-experts model chose at each position of each sequence of one call
(`NativeEngineConfig.record_routing`), for a trainer that replays them in its own forward.

The runner reads them out of the forward: a decode step's for the token each row fed, a prefill
step's for every position of each item, those of a cached prefix included. The prefix cache keeps
them beside the keys and values: a side table on the device with one entry per cache slot,
written by the same steps that write the cache and copied with its blocks, so a prompt served
from cached blocks gets the routing of the pass that computed them. Here they are gathered per
sequence as the steps' results are read, dropping those of rows that changed hands (a preempted
sequence is prefilled again, and its routing with it).
"""

from __future__ import annotations

import numpy as np
import torch


class RoutingRecord:
    """(sequence, position, sparse layer, k) chosen experts, -1 where nothing was recorded."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, num_sequences: int, length: int) -> None:
        """`shape`: (sparse layers, experts per token); room for `num_sequences` of `length`
        positions to begin with (it grows for requests that join the call)."""
        numpy_dtype = np.dtype(str(dtype).removeprefix("torch."))
        self.experts = np.full((num_sequences, length, *shape), -1, dtype=numpy_dtype)

    def _fit(self, num_sequences: int, length: int) -> None:
        """Grow the table (at least doubling a dimension that grows) to hold `num_sequences`
        sequences of `length` positions."""
        have = self.experts.shape[:2]
        if num_sequences > have[0] or length > have[1]:
            want = [
                size if size <= had else max(size, 2 * had)
                for size, had in zip((num_sequences, length), have)
            ]
            grow = [(0, size - had) for size, had in zip(want, have)]
            self.experts = np.pad(self.experts, (*grow, (0, 0), (0, 0)), constant_values=-1)

    def prefill(
        self, sequences: np.ndarray, items: np.ndarray, lengths: np.ndarray, routing: np.ndarray
    ) -> None:
        """Sequences (C,) started from items `items` (C,) of `lengths` tokens; routing (items,
        longest, layers, k) holds every position of each item."""
        if not len(sequences):
            return
        self._fit(int(sequences.max()) + 1, int(routing.shape[1]))
        for sequence, item in zip(sequences.tolist(), items.tolist()):
            self.experts[sequence, : lengths[item]] = routing[item, : lengths[item]]

    def decode(self, sequences: np.ndarray, positions: np.ndarray, routing: np.ndarray) -> None:
        """Sequences (A,) fed the tokens at `positions` (A,); routing (A, layers, k)."""
        if not len(sequences):
            return
        self._fit(int(sequences.max()) + 1, int(positions.max()) + 1)
        self.experts[sequences, positions] = routing

    def of(self, sequence: int, length: int, num_generated: int) -> torch.Tensor:
        """(length, layers, k) for a sequence of `length` tokens; -1 for the last sampled token,
        which no step fed."""
        self._fit(sequence + 1, length)
        routed = torch.from_numpy(self.experts[sequence, :length].copy())
        if num_generated:
            routed[length - 1] = -1
        return routed


class SlotRouting:
    """The device side: the experts chosen for the token in each cache slot (one row more, which
    padding and idle rows write), a decode step's routing buffer, and pinned host buffers that
    take a decode step's routing back, one per step in flight."""

    def __init__(
        self,
        shape: tuple[int, int],
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        max_rows: int,
        host_slots: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.table = torch.full((num_blocks * block_size + 1, *shape), -1, dtype=dtype, device=device)
        self.step = torch.zeros(shape[0], max_rows, shape[1], dtype=dtype, device=device)
        self.host = torch.zeros(host_slots, shape[0], max_rows, shape[1], dtype=dtype)
        if device.type == "cuda":
            self.host = self.host.pin_memory()

    def buffer(self, num_tokens: int) -> torch.Tensor:
        """Where a prefill's forward writes its routing: (sparse layers, num_tokens, k)."""
        layers, _, top_k = self.step.shape
        return torch.empty(layers, num_tokens, top_k, dtype=self.step.dtype, device=self.step.device)

    def store(self, slots: torch.Tensor, routing: torch.Tensor) -> None:
        """Keep routing (layers, T, k) at the cache slots (T,) its tokens were written to (-1: none)."""
        padding = self.table.shape[0] - 1
        self.table[torch.where(slots >= 0, slots, padding)] = routing.transpose(0, 1)

    def copy_blocks(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy whole blocks' routing, as the cache copies their keys and values."""
        blocks = self.table[:-1].view(-1, self.block_size, *self.table.shape[1:])
        blocks[destination] = blocks[source]

    def items_to_host(self, blocks: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """(items, longest, layers, k) on the host: every position of each item, from its blocks
        (a cached prefix's included; what lies past an item's end means nothing). Its copy is
        under way on return."""
        longest = max(lengths)
        positions = np.arange(longest)
        slots = np.full((len(blocks), longest), self.table.shape[0] - 1, dtype=np.int64)
        for item, (item_blocks, length) in enumerate(zip(blocks, lengths)):
            pages = np.asarray(item_blocks, dtype=np.int64)[positions[:length] // self.block_size]
            slots[item, :length] = pages * self.block_size + positions[:length] % self.block_size
        device = self.table.device
        gathered = self.table[torch.from_numpy(slots).to(device, non_blocking=True)]
        host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=device.type == "cuda")
        return host.copy_(gathered, non_blocking=True)

    def step_to_host(self, host_slot: int, rows: int) -> torch.Tensor:
        """(layers, rows, k) on the host: the last decode step's routing; its copy is under way."""
        host = self.host[host_slot, :, :rows]
        return host.copy_(self.step[:, :rows], non_blocking=True)
