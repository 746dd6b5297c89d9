"""LoRA adapters as weights on the wire: how they are named and checked.

An engine that keeps its own copy of a LoRA policy's frozen base needs only the adapters after
the first sync. They travel as ordinary `(name, tensor)` pairs through any transport, named after
the linear layer they adapt (its Hugging Face name in the plain model):

    {module}.lora_A.weight   (r, in_features)
    {module}.lora_B.weight   (out_features, r), already multiplied by lora_alpha / r

so the layer computes `x W^T + (x A^T) B^T` with no adapter config on the receiving side (several
adapters of one layer are concatenated along r). An update may mix them with plain parameters
(the base on the first sync, `modules_to_save` on every sync).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from grpoflow.transport import ReceiveError

DOWN, UP = ".lora_A.weight", ".lora_B.weight"
"""Name suffixes of an adapter's A (down) and B (up, scaled) matrices."""


def is_adapter_name(name: str) -> bool:
    return name.endswith(DOWN) or name.endswith(UP)


def adapted_module(name: str) -> str:
    """The linear layer an adapter tensor belongs to."""
    return name[: -len(DOWN)] if name.endswith(DOWN) else name[: -len(UP)]


def split_adapters(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Plain parameters, and the adapters by module name as (A, B)."""
    plain, parts = [], {}
    for name, tensor in weights:
        if is_adapter_name(name):
            parts.setdefault(adapted_module(name), {})[name.endswith(DOWN)] = tensor
        else:
            plain.append((name, tensor))
    adapters = {}
    for module, pair in parts.items():
        if len(pair) != 2:
            raise ValueError(f"adapter of {module} needs both {module}{DOWN} and {module}{UP} in one update")
        adapters[module] = (pair[True], pair[False])
    return plain, adapters


def adapter_shapes(
    names: Iterable[str], ranks: Mapping[str, int], linear_shapes: Mapping[str, Sequence[int]]
) -> dict[str, tuple[int, int]]:
    """The shapes the adapter tensors `names` must have: A (r, in) and B (out, r) of the linear
    layer they name (`linear_shapes`: its weight's (out, in)), r as `ranks` gives it per module.
    A name of no linear layer raises ReceiveError."""
    shapes = {}
    for name in names:
        module = adapted_module(name)
        if module not in linear_shapes:
            raise ReceiveError(
                f"{name} adapts {module!r}, which is not a linear layer of the model: name adapters "
                f"after the layer's Hugging Face name, e.g. 'model.layers.0.self_attn.q_proj{DOWN}'"
            )
        out_features, in_features = linear_shapes[module]
        rank = ranks.get(module, 0)  # none: no two-dimensional A or B was given
        shapes[name] = (rank, in_features) if name.endswith(DOWN) else (out_features, rank)
    return shapes


def ranks_of(shapes: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """Each adapted module's rank, read from its A matrix's given shape (B's alone: its columns),
    whatever order the names come in."""
    ranks, from_up = {}, {}
    for name, shape in shapes.items():
        matrix = _matrix(shape)
        if is_adapter_name(name) and matrix is not None:
            if name.endswith(DOWN):
                ranks[adapted_module(name)] = matrix[0]
            else:
                from_up[adapted_module(name)] = matrix[1]
    return {**from_up, **ranks}


def _matrix(shape: object) -> tuple[int, int] | None:
    """(rows, columns) of a two-dimensional `shape`; None for any other (a vector, a malformed
    shape sent as JSON), which the shape check then refuses."""
    if not isinstance(shape, Sequence) or len(shape) != 2:
        return None
    if not all(isinstance(size, int) and not isinstance(size, bool) for size in shape):
        return None
    return int(shape[0]), int(shape[1])


def check_pairs(shapes: Mapping[str, Sequence[int]]) -> None:
    """ReceiveError 400 unless every adapter among the given `shapes` (by name) comes with its
    other half, and A's rows (the rank) match B's columns; the rest of each shape is checked
    against its layer (`adapter_shapes`)."""
    halves: dict[str, dict[bool, Sequence[int]]] = {}
    for name, shape in shapes.items():
        if is_adapter_name(name):
            halves.setdefault(adapted_module(name), {})[name.endswith(DOWN)] = shape
    for module, pair in halves.items():
        down, up = f"{module}{DOWN}", f"{module}{UP}"
        if len(pair) != 2:
            given, missing = (down, up) if True in pair else (up, down)
            raise ReceiveError(
                f"the update holds {given} but not {missing}: an adapter travels as both its A and "
                f"its B (scaled), in one update"
            )
        rows, columns = _matrix(pair[True]), _matrix(pair[False])
        if rows is not None and columns is not None and rows[0] != columns[1]:
            raise ReceiveError(
                f"{up} has {columns[1]} columns, {down} {rows[0]} rows: B's columns and A's rows are "
                f"the adapter's rank and must agree"
            )
