"""What values a weight update may hold, whichever transport brought it.

Every tensor must be finite and fit the dtype of the parameter it is written into (for a LoRA
adapter's A and B, the layer's weight, whose dtype they are multiplied in). Beyond that, its
largest magnitude is bounded by the parameter's current one: at most MAGNITUDE_FACTOR times the
larger of that and MAGNITUDE_FLOOR. A training step moves weights by a small fraction, so no real
update comes near the bound, while a finite but absurd value (1e38 in a float32 weight sends every
greedy token to one id) is refused. An adapter's A and B are bounded each by its layer's bound,
and so is the largest change they can make to one of the layer's weights (rank times the largest
|A| times the largest |B|). Parameters whose values the receiver cannot read (the meta module of
an engine that keeps its own copy of the weights) are bounded by their dtype alone. Failures raise
ReceiveError (HTTP 400) naming the tensor, its largest magnitude and the bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from grpoflow.transport import ReceiveError
from grpoflow.transport.adapters import DOWN, adapted_module, is_adapter_name

MAGNITUDE_FACTOR = 1e4
"""How many times a parameter's current largest magnitude (or MAGNITUDE_FLOOR, when larger) the
values sent for it may reach."""
MAGNITUDE_FLOOR = 1.0
"""The magnitude the bound starts from for a parameter that is small or zero (a fresh bias)."""
REFUSED = "the update is refused and nothing was applied"


def check_update_values(
    tensors: Iterable[tuple[str, torch.Tensor]], parameters: Mapping[str, torch.Tensor]
) -> None:
    """Refuse the update unless every tensor (by Hugging Face name) passes `check_values` against
    its parameter in `parameters` (an adapter's A or B against the weight of the layer it adapts),
    and each adapter sent with both halves passes `check_adapter_values`. A name `parameters` lacks
    is checked for finite values alone. Names are checked in sorted order, so the refusal names the
    same tensor whatever order they arrived in (a safetensors file's order is not kept)."""
    halves: dict[str, dict[bool, torch.Tensor]] = {}
    bounds: dict[str, float | None] = {}  # an adapted weight's bound serves its A, its B and the pair

    def bound_of(target: str) -> float | None:
        if target not in bounds:
            parameter = parameters.get(target)
            bounds[target] = None if parameter is None else magnitude_bound(parameter)
        return bounds[target]

    for name, tensor in sorted(tensors, key=lambda pair: pair[0]):
        target = f"{adapted_module(name)}.weight" if is_adapter_name(name) else name
        check_values(name, tensor, parameters.get(target), bound_of(target))
        if is_adapter_name(name):
            halves.setdefault(adapted_module(name), {})[name.endswith(DOWN)] = tensor
    for module, pair in halves.items():
        if len(pair) == 2:
            check_adapter_values(module, pair[True], pair[False], bound_of(f"{module}.weight"))


def check_values(
    name: str, tensor: torch.Tensor, parameter: torch.Tensor | None = None, bound: float | None = None
) -> None:
    """Refuse `tensor` (sent as `name`) unless it is finite and, given the `parameter` it is
    written into, fits the parameter's dtype without overflowing to infinity and stays within
    `bound` (its `magnitude_bound`)."""
    if not bool(torch.isfinite(tensor).all()):
        raise ReceiveError(
            f"{name} holds NaN or infinite values: {REFUSED}; check the trainer's weights (a diverged "
            f"step) before sending them"
        )
    if parameter is None or not parameter.dtype.is_floating_point or not tensor.numel():
        return
    top = float(tensor.abs().max())
    most = torch.finfo(parameter.dtype).max
    if top > most:
        raise ReceiveError(
            f"{name} holds {top:.3g}, beyond the largest {parameter.dtype} value ({most:.3g}): it would "
            f"become infinite; {REFUSED}"
        )
    if bound is not None and top > bound:
        raise ReceiveError(
            f"{name} holds {top:.3g}, beyond its bound {bound:.3g} ({MAGNITUDE_FACTOR:g} times the "
            f"largest magnitude of the served weight it updates or adapts, or of {MAGNITUDE_FLOOR:g} "
            f"when that is smaller): {REFUSED}; a training step changes weights by a small fraction, "
            f"so check the trainer's weights"
        )


def check_adapter_values(module: str, down: torch.Tensor, up: torch.Tensor, bound: float | None) -> None:
    """Refuse the adapter of `module` (A `down`, B `up`, already checked one by one) when the
    largest change it can make to one entry of the layer's weight, rank x max |A| x max |B|, is
    beyond `bound` (the weight's `magnitude_bound`)."""
    if bound is None or not down.numel() or not up.numel():
        return
    rank, top_down, top_up = down.shape[0], float(down.abs().max()), float(up.abs().max())
    change = rank * top_down * top_up
    if change > bound:
        raise ReceiveError(
            f"the adapter of {module} can change a weight by up to {change:.3g} (rank {rank} x largest "
            f"|A| {top_down:.3g} x largest |B| {top_up:.3g}), beyond the bound {bound:.3g} of "
            f"{module}.weight: {REFUSED}"
        )


def magnitude_bound(parameter: torch.Tensor) -> float | None:
    """The largest magnitude values sent for `parameter` may hold: MAGNITUDE_FACTOR times the
    larger of its current largest magnitude and MAGNITUDE_FLOOR; None when its values cannot be
    read (on the meta device)."""
    if parameter.is_meta or not parameter.dtype.is_floating_point:
        return None
    current = float(torch.linalg.vector_norm(parameter.detach(), float("inf"))) if parameter.numel() else 0.0
    return MAGNITUDE_FACTOR * max(current, MAGNITUDE_FLOOR)
