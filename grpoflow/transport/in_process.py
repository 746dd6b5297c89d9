"""Weights handed by reference to a vLLM engine in the same process, and the worker methods that
load them.

Sending (`push`): the trainer's `(hf_name, tensor)` pairs stream into the worker's in-place reload
(vLLM's `reload_weights`, wrapped by `WeightSyncExtension`, through `LLM.collective_rpc`). With
the engine in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) the tensors pass by reference, and vLLM
processes the model layer by layer as their tensors arrive, so at most one layer is buffered: no
bucketing is needed. `batches` splits a push into that many reloads of whole decoder layers
(`layer_groups`), so that weights made for the push (merged adapters, FSDP gathers) are released
group by group instead of being held for the whole push.

Receiving (`WeightSyncExtension`): the methods grpoflow adds to vLLM's worker. They take the pairs
of a push, and a checkpoint directory too: a vLLM server started with the extension reloads the
checkpoint transport's directories through them.

vLLM is imported only inside the methods that need it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from grpoflow.transport.checkpoint_sender import RELOAD_METHOD

LAYER_INDEX = re.compile(r"\.(\d+)\.")
"""The first dotted integer of a Hugging Face name: the decoder layer's index (model.layers.3.mlp...)."""


class ReloadingEngine(Protocol):
    """What a push needs of vLLM's `LLM`."""

    def collective_rpc(self, method: str, *args: Any, kwargs: dict | None = None, **rest: Any) -> Any: ...

    def reset_prefix_cache(self) -> Any: ...


def layer_groups(
    weights: Iterable[tuple[str, torch.Tensor]], num_groups: int, num_layers: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive lists of `(name, tensor)` holding whole decoder layers: layer i goes to group
    `i * num_groups // num_layers`, so there are min(num_groups, num_layers) groups of near-equal
    numbers of layers. A tensor outside the layers (embeddings, final norm, head) joins the group
    being collected when it arrives. The pairs are consumed lazily: a group is collected only when
    the previous one has been taken. Expects the tensors layer by layer, as `named_parameters()`
    and the FSDP gather give them (vLLM rebuilds a fused layer, q/k/v or gate/up, from one load).
    """
    if num_groups < 1 or num_layers < 1:
        raise ValueError(f"need num_groups >= 1 and num_layers >= 1, got {num_groups} and {num_layers}")
    group: list[tuple[str, torch.Tensor]] = []
    current = 0
    for name, tensor in weights:
        match = LAYER_INDEX.search(name)
        index = current if match is None else min(int(match[1]), num_layers - 1) * num_groups // num_layers
        if index > current and group:
            yield group
            group = []
        current = max(current, index)
        group.append((name, tensor.detach()))
    if group:
        yield group


def push(
    llm: ReloadingEngine,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    batches: int | None,
    num_layers: int,
) -> None:
    """Load the pairs into `llm` in one reload, or in `batches` groups of whole layers taken from
    the stream one at a time, each released before the next is collected; then drop its cached KV
    blocks, which were computed with the old weights."""
    if batches is None:
        reload(llm, list(weights))
    else:
        for group in layer_groups(weights, batches, num_layers):
            reload(llm, group)
            del group
    llm.reset_prefix_cache()


def reload(llm: ReloadingEngine, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Stream the pairs into vLLM's in-place reload (vLLM processes each layer as soon as all
    its tensors have arrived, so at most one layer is buffered; in-process nothing is copied)."""
    try:
        llm.collective_rpc(RELOAD_METHOD, kwargs={"weights_iterator": iter(weights)})
    except Exception as error:
        raise RuntimeError(
            f"loading {len(weights)} tensors ({weights[0][0]!r} .. {weights[-1][0]!r}) into vLLM "
            f"failed: {error!r}; check that the names are the Hugging Face names of the served model"
        ) from error


def reload_directory(llm: ReloadingEngine, directory: str | Path) -> None:
    """Load the safetensors checkpoint in `directory` into `llm`, then drop its cached KV blocks."""
    llm.collective_rpc(RELOAD_METHOD, kwargs={"weights_path": str(directory)})
    llm.reset_prefix_cache()


class WeightSyncExtension:
    """Methods grpoflow adds to vLLM's worker (vLLM's `worker_extension_cls`), called by name
    through `collective_rpc`; servers get them with
    `--worker-extension-cls grpoflow.engines.vllm.WeightSyncExtension`.

    vLLM's in-place `reload_weights` refreshes the layers whose tensors it receives. On the CPU
    vLLM also keeps a packed copy of the LM head's weight for its GEMM; with tied embeddings no
    tensor arrives under the LM head's name, so that copy would keep the old embedding. These
    methods re-pack it after every reload (a no-op on GPUs, which use the weight directly).
    """

    def grpoflow_reload_weights(self, weights_iterator=None, weights_path: str | None = None) -> None:
        """Reload from `(hf_name, tensor)` pairs or a directory of safetensors, then re-pack."""
        self.reload_weights(weights_iterator=weights_iterator, weights_path=weights_path)
        repack_lm_heads(self.model_runner.model)

    def grpoflow_weight_sync_ready(self) -> bool:
        """Lets a client check that the extension is installed."""
        return True


def repack_lm_heads(model: torch.nn.Module) -> int:
    """Re-run the unquantized LM heads' post-load step from their current weight; returns how many."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
    )

    heads = [
        module
        for module in model.modules()
        if isinstance(module, ParallelLMHead) and isinstance(module.quant_method, UnquantizedEmbeddingMethod)
    ]
    for head in heads:
        head.quant_method.process_weights_after_loading(head)
    return len(heads)
