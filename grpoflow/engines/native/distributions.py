"""The engine's whole next-token distribution at a few sampled positions of a call, which the
trainer compares with its own (`sampling/distribution_{tv,kl}/*`).

Each sampled position gets a priority from its draw's key (a hash of the key: it depends on the
sequence's seed and the token's place, never on the batch). A call keeps the `count` positions of
lowest priority, a uniform random sample of its positions (bottom-k sampling). The keys of a step
are known on the host before it is launched, so the host picks the rows there and the device
computes `log_softmax(logits / temperature)` in float32 for those rows only (before any
repetition penalty or truncation), kept where the logits are: the engine runs in the trainer's
process. Positions evicted by lower priorities later in the call are dropped; a call keeps
about `count * (1 + ln(tokens / count))` rows over its life and `count` at its end.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from grpoflow.algo.draws import hash32_numpy

PRIORITY_SALT = 0x5BD1E995
"""Mixed into a draw's key for its priority, so the priority is not the draw's own uniform."""


class DistributionCapture:
    """The kept positions of one call: `select` at launch, `record` when a step's results are
    read, `take` per sequence at the end."""

    def __init__(self, count: int, inverse_temperature: float) -> None:
        self.count, self.inverse_temperature = count, inverse_temperature
        self.heap: list[tuple[int, int, int]] = []  # (-priority, sequence, position): the kept
        self.live: set[tuple[int, int]] = set()
        self.rows: dict[tuple[int, int], torch.Tensor] = {}

    def select(self, sequences: np.ndarray, positions: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Indices (into the step's rows) of the positions to keep, given their draws' keys."""
        priorities = hash32_numpy(keys.astype(np.uint64) ^ PRIORITY_SALT)
        bound = -self.heap[0][0] if len(self.heap) >= self.count else 2**32
        chosen = []
        for index in np.nonzero(priorities < bound)[0].tolist():
            entry = (-int(priorities[index]), int(sequences[index]), int(positions[index]))
            if len(self.heap) >= self.count:
                if -entry[0] >= -self.heap[0][0]:
                    continue
                _, sequence, position = heapq.heapreplace(self.heap, entry)
                self.live.discard((sequence, position))
                self.rows.pop((sequence, position), None)
            else:
                heapq.heappush(self.heap, entry)
            self.live.add(entry[1:])
            chosen.append(index)
        return np.array(chosen, dtype=np.int64)

    def rows_of(self, logits: torch.Tensor, chosen: np.ndarray) -> torch.Tensor | None:
        """The chosen rows' float32 log-softmax at the call's temperature, or None."""
        if not len(chosen):
            return None
        # from pageable memory without waiting for the device: the decode loop stays ahead of it
        index = torch.from_numpy(chosen).to(logits.device, non_blocking=True)
        return (logits[index].float() * self.inverse_temperature).log_softmax(dim=-1)

    def record(
        self, sequences: np.ndarray, positions: np.ndarray, rows: torch.Tensor, current: np.ndarray
    ) -> None:
        """Keep the rows of positions still kept whose result was recorded (`current`)."""
        for row, (sequence, position, kept) in enumerate(
            zip(sequences.tolist(), positions.tolist(), current)
        ):
            if kept and (sequence, position) in self.live:
                self.rows[(sequence, position)] = rows[row]

    def take(self, sequence: int, length: int) -> dict[int, torch.Tensor] | None:
        """Position -> log-softmax row of the kept positions of `sequence` within its `length`
        tokens; None when it has none."""
        found = {
            position: row
            for (owner, position), row in self.rows.items()
            if owner == sequence and position < length
        }
        return found or None
