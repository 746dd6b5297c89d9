"""torch.compile of the policy's decoder layers for the update, and Inductor's caches kept across
runs so that a run's first step reuses what an earlier run of the same shapes compiled.

Inductor writes its FX graph and autotuning caches under TORCHINDUCTOR_CACHE_DIR (a temporary
directory unless set, gone with the machine's /tmp); grpoflow points it at its own cache directory
and turns the FX graph cache on, each only when the user has not set the variable. Layers compile
with dynamic shapes, so micro-batches of other sizes and lengths reuse one graph.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

import torch

logger = logging.getLogger("grpoflow.policy.compiling")

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
FX_GRAPH_CACHE_ENV = "TORCHINDUCTOR_FX_GRAPH_CACHE"


def inductor_cache_dir(environ: MutableMapping[str, str]) -> Path:
    """grpoflow's Inductor cache: $XDG_CACHE_HOME/grpoflow/inductor (~/.cache by default)."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "grpoflow" / "inductor"


def persist_inductor_caches(environ: MutableMapping[str, str] = os.environ) -> None:
    """Point Inductor's caches at grpoflow's cache directory and turn its FX graph cache on,
    leaving each variable the user set as it is."""
    environ.setdefault(CACHE_DIR_ENV, str(inductor_cache_dir(environ)))
    environ.setdefault(FX_GRAPH_CACHE_ENV, "1")
    if environ is os.environ and environ[FX_GRAPH_CACHE_ENV] == "1":
        import torch._inductor.config as inductor_config  # read the variable at import: set it too

        inductor_config.fx_graph_cache = True


def compile_layers(model: torch.nn.Module, *, fallback: bool = False) -> bool:
    """torch.compile every decoder layer in place (dynamic shapes: micro-batches vary in size and
    length); whether it did. A model without `model.layers` is refused (ValueError), or under
    `fallback` (torch_compile chosen, not given) trains uncompiled with one log line, and a layer
    Inductor then fails to compile runs eagerly."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        message = "torch_compile needs a model with model.layers (Llama-style decoders)"
        if not fallback:
            raise ValueError(message)
        logger.warning("%s: training uncompiled", message)
        return False
    persist_inductor_caches()
    if fallback:
        import torch._dynamo

        torch._dynamo.config.suppress_errors = True
    for layer in layers:
        layer.compile(dynamic=True)
    return True


def trace_every_layer_alike(model: torch.nn.Module) -> None:
    """Mark the input embeddings' output as requiring grad when no embedding weight trains (LoRA),
    so that the first decoder layer's input is like every later layer's and a compiled layer
    traces one graph for all of them, not a second for the first: half the compile time, for one
    layer's input gradient."""
    embeddings = model.get_input_embeddings()
    if any(parameter.requires_grad for parameter in embeddings.parameters()):
        return

    def requiring_grad(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
        return output.requires_grad_(True) if torch.is_grad_enabled() else output

    embeddings.register_forward_hook(requiring_grad)
