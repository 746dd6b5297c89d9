"""torch.compile of the policy's decoder layers for the update, and Inductor's caches kept across
runs so that a run's first step reuses what an earlier run of the same shapes compiled.

Inductor writes its FX graph and autotuning caches under TORCHINDUCTOR_CACHE_DIR, by default a
directory in /tmp (gone with the machine's /tmp), which importing `torch._inductor.config` writes
into the environment. Unless the user chose another directory, grpoflow points the variable at a
directory of its own (`inductor_cache_dir`) and turns the FX graph cache on unless the user set
that. Its directory is named by a key of grpoflow's source, the layers' own source files and the
versions of the libraries whose code compiles into them, so AOTAutograd's cache may keep graphs
that hold custom autograd functions (grpoflow's LoRA dropout, its fused kernels): torch leaves
them out by default, its key not covering the functions' backward code, which a new key here
does. On an H200, a second run of the standard 0.5B update's shapes compiled its first step in
2.7 s against 13.1 s from empty caches (benchmarks/results/2026-11-28-compile-20-steps-*). Layers
compile with dynamic shapes, so micro-batches of other sizes and lengths reuse one graph. A training
run compiles them beside training (`background_compile`): its first steps run them uncompiled
while a thread compiles, so no step waits for the compiler.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import logging
import os
from collections.abc import Callable, MutableMapping
from pathlib import Path

import torch

from grpoflow.policy.background_compile import CompiledBeside
from grpoflow.policy.compile_costs import grpoflow_cache_dir

logger = logging.getLogger("grpoflow.policy.compiling")

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
FX_GRAPH_CACHE_ENV = "TORCHINDUCTOR_FX_GRAPH_CACHE"


CACHE_KEY_LIBRARIES = ("torch", "triton", "transformers", "peft", "liger-kernel")
"""Libraries whose versions name grpoflow's Inductor cache besides grpoflow's own source."""


def inductor_cache_dir(environ: MutableMapping[str, str], sources: tuple[str, ...] = ()) -> Path:
    """grpoflow's Inductor cache: $XDG_CACHE_HOME/grpoflow/inductor/KEY (~/.cache by default),
    KEY naming grpoflow's source, the versions of CACHE_KEY_LIBRARIES and the files `sources`
    (`cache_key`)."""
    return grpoflow_cache_dir(environ) / "inductor" / cache_key(sources)


@functools.cache
def cache_key(sources: tuple[str, ...] = ()) -> str:
    """16 hex digits of a hash of every grpoflow source file, the files `sources` (the compiled
    layers' own code: a model's remote code) and CACHE_KEY_LIBRARIES' versions."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    files = [(str(path.relative_to(package)), path) for path in sorted(package.rglob("*.py"))]
    for name, path in files + [(source, Path(source)) for source in sorted(set(sources))]:
        digest.update(name.encode())
        digest.update(path.read_bytes())
    for library in CACHE_KEY_LIBRARIES:
        try:
            version = importlib.metadata.version(library)
        except importlib.metadata.PackageNotFoundError:
            version = "-"
        digest.update(f"{library}={version}".encode())
    return digest.hexdigest()[:16]


def torch_default_cache_dir() -> str:
    """The directory Inductor falls back to, which importing its config writes into the
    environment: the value that means the user chose none."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def persist_inductor_caches(
    environ: MutableMapping[str, str] = os.environ, sources: tuple[str, ...] = ()
) -> Path | None:
    """Point Inductor's caches at grpoflow's cache directory for the code in `sources` (see
    `cache_key`) unless the user chose another (a TORCHINDUCTOR_CACHE_DIR other than torch's
    default), turn its FX graph cache on unless the user set it, and, in grpoflow's directory
    only, let AOTAutograd's cache keep graphs with custom autograd functions. Returns grpoflow's
    directory when it is the one in use."""
    chosen = environ.get(CACHE_DIR_ENV)
    ours = None
    if chosen is None or os.path.abspath(chosen) == torch_default_cache_dir():
        ours = inductor_cache_dir(environ, sources)
        environ[CACHE_DIR_ENV] = str(ours)
    environ.setdefault(FX_GRAPH_CACHE_ENV, "1")
    if environ is os.environ:
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config  # read the variable at import: set it too

        if environ[FX_GRAPH_CACHE_ENV] == "1":
            inductor_config.fx_graph_cache = True
        if ours is not None:
            functorch_config.autograd_cache_allow_custom_autograd_functions = True
    return ours


def compile_layers(
    model: torch.nn.Module, *, fallback: bool = False, backend: str = "inductor", beside: bool = False
) -> bool:
    """torch.compile every decoder layer in place (dynamic shapes: micro-batches vary in size and
    length); whether it did. A model without `model.layers` is refused (ValueError), or under
    `fallback` (torch_compile chosen, not given) trains uncompiled with one log line, and a layer
    Inductor then fails to compile runs eagerly. `backend` is torch.compile's (tests trace with
    "eager", which generates no kernels). `beside`: the layers run eagerly while a background
    thread compiles them (`background_compile.CompiledBeside`), rather than compiling in the
    first micro-batch.

    The layers are traced under `_layer_tracing`: their float attributes (an RMSNorm's epsilon, a
    LoRA layer's scaling, a dropout probability) as constants, since under dynamic shapes recent
    Dynamo traces them as inputs, finds that some cannot stay inputs, and traces and partitions the
    whole layer again with them constant (a cost every run pays anew, the first attempt's graph
    never reaching AOTAutograd's cache); and each dimension as its own symbol, since by default two
    sizes equal in the first call share one (a micro-batch of 64 rows and a head width of 64), and
    the next micro-batch of another size traced the layer again."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        message = "torch_compile needs a model with model.layers (Llama-style decoders)"
        if not fallback:
            raise ValueError(message)
        logger.warning("%s: training uncompiled", message)
        return False
    persist_inductor_caches(sources=layer_sources(layers))
    if fallback:
        import torch._dynamo

        torch._dynamo.config.suppress_errors = True
    for layer in layers:
        layer.compile(dynamic=True, backend=backend)
        layer._compiled_call_impl = _layer_tracing(layer._compiled_call_impl)
    if beside:
        CompiledBeside(layers, [layer._compiled_call_impl for layer in layers], fallback=fallback)
    return True


def _layer_tracing(compiled: Callable) -> Callable:
    """`compiled` traced with Python floats as constants (Dynamo's `specialize_float`) and without
    duck sizing (`use_duck_shape`), for these calls only: other code the process compiles keeps
    torch's settings."""
    import torch._dynamo
    import torch.fx.experimental._config as shape_config

    @functools.wraps(compiled)
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(specialize_float=True), shape_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return call


def layer_sources(layers: torch.nn.Module) -> tuple[str, ...]:
    """The source files of the classes of every module in `layers` (the model's own modeling
    code, remote code included, and its adapters'), where Python can find them."""
    files = set()
    for module in layers.modules():
        try:
            files.add(inspect.getsourcefile(type(module)))
        except (TypeError, OSError):  # a class defined in C, or in no file
            continue
    return tuple(sorted(path for path in files if path and os.path.isfile(path)))


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
