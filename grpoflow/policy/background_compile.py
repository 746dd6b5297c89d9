"""Decoder layers that train eagerly while a background thread compiles them.

A compiled layer's first call traces it (Dynamo) and compiles or loads its kernels (AOTAutograd,
Inductor): seconds that the first micro-batch waits for. `CompiledBeside` routes every layer's
call through a dispatcher instead. The first training call of the first layer hands a copy of its
inputs to a thread, which runs the compiled layer forward and backward once, on a CUDA stream of
its own, while the layers go on running eagerly. The first forward pass that starts after the
thread has finished runs every layer compiled, and so does every pass after it.

The choice is made when the first layer starts a pass outside the backward pass, and it holds
until the next such start: a layer recomputed under gradient checkpointing runs as it ran
forward. Layers under FSDP compile on their first call instead (the thread would run FSDP's
gathers beside the training's). If the thread's compilation fails, a run that chose
`torch_compile` itself (`fallback`) trains on uncompiled with one log line; a run given
`torch_compile: true` raises the error at the next pass. A process that ends while the thread
compiles waits for it at exit (before the executor Inductor compiles on shuts down), rather than
leaving the compilation to fail half way.

On an H200, the standard 0.5B workload's 20 steps took 36.60 s compiled this way with Inductor's
caches warm, against 37.17 s uncompiled (with Liger's kernels) in the same call
(2026-11-28-compile-20-steps-beside-*): the first update no longer waits for the compiler, and the
layers ran compiled from the second step. With the caches empty the run took 47.99 s: the
compilation, mostly Python, slows the training thread while both hold the interpreter. Until the
switch the layers run as plain transformers layers (the run chose compiling over Liger's kernels),
whose activations the memory plan counts (50.7 GiB measured against 50.0 planned there; 54.1 with
the caches empty).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

logger = logging.getLogger("grpoflow.policy.compiling")


class CompiledBeside:
    """`layers` run eagerly until `compiled` (their compiled calls, by layer) is ready, then
    compiled; see the module docstring."""

    def __init__(self, layers: Sequence[nn.Module], compiled: Sequence[Callable], *, fallback: bool) -> None:
        self.layers, self.compiled, self.fallback = list(layers), list(compiled), fallback
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.settled = False
        """Compiled, or given up: the dispatcher no longer looks at the thread."""
        self.use_compiled = False
        for index, layer in enumerate(self.layers):
            layer._compiled_call_impl = functools.partial(self._call, index)

    @staticmethod
    def of(layer: nn.Module) -> CompiledBeside | None:
        """The `CompiledBeside` dispatching `layer`'s calls; None once it switched or gave up."""
        call = layer._compiled_call_impl
        owner = getattr(getattr(call, "func", None), "__self__", None)
        return owner if isinstance(owner, CompiledBeside) else None

    def _call(self, index: int, *args: Any, **kwargs: Any) -> Any:
        if index == 0 and not self.settled and torch._C._current_graph_task_id() == -1:
            self._begin_pass(args, kwargs)
        if self.use_compiled:
            return self.compiled[index](*args, **kwargs)
        return self.layers[index]._call_impl(*args, **kwargs)

    def _begin_pass(self, args: tuple, kwargs: dict) -> None:
        """At the start of a pass: switch to the compiled layers once the thread is done, or start
        it on a training pass's inputs."""
        if self.thread is not None and not self.thread.is_alive():
            self._settle()
        elif (
            self.thread is None
            and torch.is_grad_enabled()
            and _needing_gradients((args, kwargs), self.layers[0])
        ):
            if _sharded(self.layers[0]):
                self._switch()
                return
            self._start(args, kwargs)

    def _start(self, args: tuple, kwargs: dict) -> None:
        inputs = tree_map_only(torch.Tensor, _copy, (args, kwargs))
        device = next(t.device for t in tree_leaves(inputs) if isinstance(t, torch.Tensor))
        copied = torch.cuda.Event() if device.type == "cuda" else None
        if copied is not None:
            copied.record()
        self.thread = threading.Thread(
            target=self._compile, args=(inputs, device, copied), name="grpoflow-compile"
        )
        self.thread.start()
        # Joined when the interpreter shuts down, before concurrent.futures shuts down the executor
        # Inductor compiles on (threading's own exit hooks run last registered, first called).
        threading._register_atexit(self.thread.join)

    def _compile(self, inputs: tuple[tuple, dict], device: torch.device, copied: Any) -> None:
        """Run the first layer's compiled call forward and backward on `inputs` (a copy of a
        training pass's), which traces and compiles (or loads) both graphs."""
        try:
            stream = None
            if device.type == "cuda":
                torch.cuda.set_device(device)  # this thread's own current device
                stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream) if stream is not None else nullcontext(), torch.enable_grad():
                if stream is not None:
                    stream.wait_event(copied)
                args, kwargs = inputs
                output = self.compiled[0](*args, **kwargs)
                hidden = output[0] if isinstance(output, (tuple, list)) else output
                needing = _needing_gradients(inputs, self.layers[0])
                if needing and hidden.requires_grad:
                    torch.autograd.grad(hidden, needing, torch.ones_like(hidden), allow_unused=True)
            if stream is not None:
                stream.synchronize()
        except BaseException as error:  # handed to the training thread at its next pass
            self.error = error

    def _settle(self) -> None:
        self.settled = True
        if self.error is None:
            self._switch()
            logger.info("decoder layers compiled beside training: compiled from this pass on")
            return
        if not self.fallback:
            raise RuntimeError(
                f"torch_compile: compiling the decoder layers failed: {self.error}"
            ) from self.error
        logger.warning("compiling the decoder layers failed (%s): training uncompiled", self.error)
        for layer in self.layers:
            layer._compiled_call_impl = None

    def _switch(self) -> None:
        self.settled = self.use_compiled = True
        for layer, compiled in zip(self.layers, self.compiled):
            layer._compiled_call_impl = compiled


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides, detached, requiring grad as `tensor` does."""
    copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
    copy.copy_(tensor.detach())
    return copy.requires_grad_(tensor.requires_grad)


def _needing_gradients(inputs: Any, layer: nn.Module) -> list[torch.Tensor]:
    """What a pass with gradients on computes gradients for at `layer`: the tensors in `inputs`
    that require them (the layers below train), else the layer's own trained parameters; empty
    when the pass trains nothing there."""
    tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    return tensors or [p for p in layer.parameters() if p.requires_grad]


def _sharded(layer: nn.Module) -> bool:
    """Whether FSDP shards `layer` (its calls gather and reduce with the other ranks)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(layer, FSDPModule)
