"""The metrics of one update, summed over its micro-batches and optimizer steps on the device."""

from __future__ import annotations

from collections.abc import Mapping

import torch

_EXTREMES = {"/min": torch.minimum, "/max": torch.maximum}
"""Name endings of metrics kept as extremes, and how two values of one combine."""


class MetricsAccumulator:
    """Adds up each metric's values and averages them at the end; a metric named `.../min` or
    `.../max` keeps its extreme instead, and one given as a (sum, count) pair is the sum of its
    sums over the sum of its counts (a mean over every call's items, however many each had).
    Values stay where they are (on the device) until `result`: a float() per micro-batch would
    stall the GPU."""

    __slots__ = ("_counts", "_totals", "_pairs")

    def __init__(self) -> None:
        self._totals: dict[str, torch.Tensor | float] = {}
        self._counts: dict[str, int] = {}
        self._pairs: set[str] = set()

    def add(self, metrics: Mapping[str, torch.Tensor | float | tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add one micro-batch's (or optimizer step's) 0-dim metrics, or (sum, count) pairs."""
        for name, value in metrics.items():
            if isinstance(value, tuple):
                pair = torch.stack([part.detach().double() for part in value])
                self._totals[name] = self._totals.get(name, 0.0) + pair
                self._counts[name] = 1
                self._pairs.add(name)
                continue
            value = value.detach() if isinstance(value, torch.Tensor) else value
            extreme = next((keep for end, keep in _EXTREMES.items() if name.endswith(end)), None)
            if extreme is not None and name in self._totals:
                self._totals[name] = extreme(self._totals[name], value)
                continue
            self._totals[name] = self._totals.get(name, 0.0) + value
            self._counts[name] = self._counts.get(name, 0) + 1

    def result(self) -> dict[str, float]:
        """Each metric's mean (or extreme) as a float, in the order the metrics first came; the
        tensors of one device reach the host in one copy."""
        values = {name: total for name, total in self._totals.items() if not isinstance(total, torch.Tensor)}
        by_device: dict[torch.device, list[str]] = {}
        for name, total in self._totals.items():
            if isinstance(total, torch.Tensor):
                by_device.setdefault(total.device, []).append(name)
        for names in by_device.values():
            copied = iter(torch.cat([self._totals[name].reshape(-1).double() for name in names]).tolist())
            for name in names:
                if name in self._pairs:
                    total, count = next(copied), next(copied)
                    values[name] = total / max(count, 1.0)
                else:
                    values[name] = next(copied)
        return {name: float(values[name]) / self._counts[name] for name in self._totals}
