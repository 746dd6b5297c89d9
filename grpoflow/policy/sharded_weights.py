"""A sharded (FSDP2) policy's weights for a rollout engine with its own copy, one unit at a time.

`Placement.rollout_weights` of a sharded policy walks its FSDP units: the root (embeddings, final
norm, output head, less the decoder layers), then each decoder layer, each gathered only while
its share is given and every tensor handed over as a CPU copy, so neither the rank's device nor
an engine that collects the whole list holds more than one gathered unit at a time. What each
unit gives is `lora.rollout_parts`'s choice, as for a whole policy: the merged weights; or, for
an engine that adds a LoRA policy's adapters to its own copy of the base, the unmerged base with
the adapters on its first sync and then the adapters (and `modules_to_save`) alone. Those later
syncs gather no unit: each adapter tensor is gathered by itself (`lora.whole`), so they move the
adapters' megabytes rather than every adapted layer, in the adapters' own dtype as from an
unsharded policy (unless the shards were offloaded to the CPU: then their units are gathered).

Each gather is a collective: every rank walks the same units in the same order, which holds
because the walk depends only on the model's structure and on what the engine holds (every
rank's engine took the same syncs).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from grpoflow.policy import lora


def gathered_weights(
    model: nn.Module, root: nn.Module, layers: nn.ModuleList, parts: lora.RolloutParts
) -> Iterator[tuple[str, torch.Tensor]]:
    """`parts` of the sharded `model` (FSDP root unit `root`, one unit per decoder layer in
    `layers`) on the CPU, named as for the whole model; what comes with a gathered unit is in the
    mixed-precision dtype when one is set, adapters gathered alone in their own. Every rank must
    walk it to the end in step."""
    base = lora.generation_model(model)
    prefix = next(name for name, module in base.named_modules() if module is layers)
    seen: set[int] = set()
    with torch.no_grad():
        yield from _unit_weights(root, base, "", parts, seen, skip=(layers,))
        for index, layer in enumerate(layers):
            yield from _unit_weights(layer, layer, f"{prefix}.{index}.", parts, seen)


def _unit_weights(
    unit: nn.Module,
    module: nn.Module,
    prefix: str,
    parts: lora.RolloutParts,
    seen: set[int],
    skip: tuple[nn.Module, ...] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """The share of `module` (less `skip`), whose parameters the FSDP `unit` holds, gathered and
    copied to the CPU; no gather when `parts` needs nothing of it, and the adapters alone gathered
    tensor by tensor rather than with the unit."""
    if not parts.needs(module, skip):
        return
    alone = parts.adapters and not parts.with_base and _shards_where_they_compute(unit)
    with nullcontext() if alone else unsharded(unit):
        for name, tensor in parts.weights(module, prefix, seen, skip):
            yield name, tensor.detach().to("cpu", copy=True)


def _shards_where_they_compute(unit: nn.Module) -> bool:
    """Whether `unit`'s shards live on the device type their mesh communicates on (not offloaded
    to the CPU under a GPU mesh), so a tensor of them can be gathered by itself."""
    from torch.distributed.tensor import DTensor

    return all(
        not isinstance(parameter, DTensor)
        or parameter.to_local().device.type == parameter.device_mesh.device_type
        for parameter in unit.parameters()
    )


@contextmanager
def unsharded(unit: nn.Module) -> Iterator[None]:
    """Within the block the FSDP `unit` holds its full parameters (a collective)."""
    unit.unshard()
    try:
        yield
    finally:
        unit.reshard()
