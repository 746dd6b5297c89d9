"""The most tensor memory alive at once while a function runs, on any device (the CPU included):
every storage an operation creates counts from its creation until it is freed."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(tensor, torch.Tensor) or tensor._is_view():
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.alive:
                continue
            self.alive.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, size)
        return out

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self.alive.discard(key)


def peak_live_bytes(function: Callable[[], object]) -> int:
    """Run `function`; the largest total size of the storages its operations made that were alive
    at the same time."""
    with _LiveBytes() as tracker:
        function()
    return tracker.peak
