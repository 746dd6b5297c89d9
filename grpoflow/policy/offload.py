"""Moving a replicated policy's memory to the CPU while it is not needed (ms-swift's options).

- `offload_model`: a module's parameters and buffers go to the CPU while another phase runs (the
  policy while an engine with its own copy of the weights generates; the reference model except
  during its log-prob pass) and come back before they are used.
- `offload_optimizer`: the optimizer state (AdamW's two moments, twice the trainable parameters in
  float32) lives on the CPU between optimizer steps and comes back for each step.
- `gc_collect_after_offload`: `gc.collect()` and `torch.cuda.empty_cache()` after each offload, so
  the caching allocator hands the freed blocks back (to vLLM, to the driver).

Every move is a copy into a fresh tensor on the target device, assigned back to the same
`Parameter` object (`parameter.data = copy`), so the optimizer and the engines keep their
references; on a CPU-only machine the copies are real too (new storage), which is what the tests
check. Sharded (FSDP) models are not moved by hand: FSDP's own CPU offload does it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from grpoflow.phases import phase

CPU = torch.device("cpu")


def move_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of `tensor` on `device` (pinned host memory when it goes to the CPU from a GPU, so
    the copy back is asynchronous)."""
    pin = device.type == "cpu" and tensor.device.type == "cuda"
    target = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pin)
    return target.copy_(tensor, non_blocking=pin)


def move_module(module: nn.Module, device: torch.device) -> int:
    """Move `module`'s parameters and buffers to `device` in place (the same Parameter objects,
    new storage); tied tensors move once. Returns the bytes moved."""
    moved, seen = 0, set()
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            tensor.data = move_tensor(tensor.data, device)
            moved += tensor.numel() * tensor.element_size()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return moved


def release_memory() -> None:
    """Collect garbage and return the caching allocator's free blocks to the driver (part of the
    `offload` phase)."""
    with phase("offload"):
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@contextmanager
def module_offloaded(module: nn.Module, home: torch.device, *, gc_collect: bool = False) -> Iterator[int]:
    """Within the block `module` lives on the CPU; leaving, it goes back to `home`. Yields the
    bytes moved out. The moves are charged to the `offload` and `reload` phases."""
    with phase("offload"):
        moved = move_module(module, CPU)
    if gc_collect:
        release_memory()
    try:
        yield moved
    finally:
        with phase("reload"):
            move_module(module, home)


class OptimizerOffload:
    """Keeps `optimizer`'s state on the CPU between steps: a step pre-hook brings every state
    tensor back next to its parameter, a post-hook sends it out again. Attach once, before the
    first step (AdamW creates its state in the first step, on the parameters' device).

    `offloaded_bytes` is the size of the state moved out after the last step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, gc_collect: bool = False) -> None:
        self.optimizer = optimizer
        self.gc_collect = gc_collect
        self.offloaded_bytes = 0
        optimizer.register_step_pre_hook(lambda *_: self.load())
        optimizer.register_step_post_hook(lambda *_: self.offload())

    def load(self) -> None:
        """Every offloaded state tensor back on its parameter's device."""
        if self.offloaded_bytes:
            with phase("reload"):
                self._move(lambda parameter: parameter.device)
        self.offloaded_bytes = 0

    def offload(self) -> None:
        """Every state tensor to the CPU (scalars such as AdamW's step count stay where the
        optimizer keeps them)."""
        with phase("offload"):
            self.offloaded_bytes = self._move(lambda _parameter: CPU)
        if self.gc_collect:
            release_memory()

    def _move(self, target) -> int:
        moved = 0
        for parameter, state in self.optimizer.state.items():
            device = target(parameter)
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[key] = move_tensor(value, device)
                    moved += value.numel() * value.element_size()
        if any(parameter.device.type == "cuda" for parameter in self.optimizer.state):
            torch.cuda.synchronize()
        return moved
