"""One matrix product for q/k/v and one for gate/up, over the policy's own parameters.

Decode steps are small: at 512 rows a Qwen2-0.5B layer's k and v products take ~4 us each, mostly
fixed cost, so three q/k/v products cost twice one fused product. `alias_rows` places the weights
of sibling projections back to back in one buffer (once, when the engine is built) by pointing each
parameter's `.data` at its slice: the parameters keep their identity, so optimizers, gradient
hooks and state dicts see no difference, and an optimizer step updates the fused buffer in place.
`rows_view` then finds the fused matrix on every refresh. When something has since given a
parameter new storage (`module.to`; FSDP, which gathers each unit's weights into tensors of their
own for every rollout), it returns None, and for the length of one engine call `copy_missing`
fills the gap with a concatenated copy of the projections' current values (`drop_copies` frees it
when the call ends), so the products stay fused at the cost of that copy's memory and the result
never goes stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(slots=True)
class Fused:
    """A layer's fused projections: views over the policy's parameters, or copies made for one
    engine call (named in `copies`); None: run them apart."""

    qkv_weight: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    gate_up_weight: torch.Tensor | None = None
    qkv_down: torch.Tensor | None = None
    gate_up_down: torch.Tensor | None = None
    copies: tuple[str, ...] = ()


def _plain(tensors: Sequence[torch.Tensor]) -> bool:
    first = tensors[0]
    return all(
        type(t) in (torch.Tensor, nn.Parameter)
        and t.is_contiguous()
        and t.dtype == first.dtype
        and t.device == first.device
        and t.shape[1:] == first.shape[1:]
        for t in tensors
    )


def alias_rows(tensors: Sequence[torch.Tensor]) -> bool:
    """Move `tensors` (same dtype, device and trailing shape) into one new buffer, concatenated
    along dim 0, by re-pointing their `.data`. Returns whether it did (False leaves them as they
    were: mixed dtypes or devices, non-contiguous tensors, tensor subclasses such as DTensor)."""
    if not tensors or not _plain(tensors):
        return False
    if rows_view(tensors) is not None:
        return True
    with torch.no_grad():
        fused = torch.cat([t.detach() for t in tensors])
        for tensor, part in zip(tensors, fused.split([t.shape[0] for t in tensors])):
            tensor.data = part
    return True


def rows_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The concatenation of `tensors` along dim 0 as a view, when they lie back to back in one
    storage (as `alias_rows` leaves them); else None."""
    if not tensors or not _plain(tensors):
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    expected = first.data_ptr()
    for tensor in tensors:
        if tensor.untyped_storage().data_ptr() != storage or tensor.data_ptr() != expected:
            return None
        expected += tensor.numel() * tensor.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def qkv_parts(attention: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor] | None] | None:
    """q/k/v weights and biases (None when none has a bias); None when only some have a bias (not
    fusable)."""
    projections = [attention.q_proj, attention.k_proj, attention.v_proj]
    biases = [module.bias for module in projections]
    if any(bias is None for bias in biases) and any(bias is not None for bias in biases):
        return None
    return [module.weight for module in projections], None if biases[0] is None else biases


def copy_missing(
    fused: Fused,
    qkv: tuple[list[torch.Tensor], list[torch.Tensor] | None] | None,
    gate_up: list[torch.Tensor] | None,
) -> bool:
    """Fill the fused matrices `fused` lacks (parts not back to back) with copies of the parts'
    current values: q/k/v (`qkv_parts`, biases with them) and gate/up (None for a sparse MLP).
    Whether it made any; they go stale when the parts change, so `drop_copies` ends their use."""
    made = []
    if qkv is not None and fused.qkv_weight is None:
        weights, biases = qkv
        if _plain(weights) and (biases is None or _plain(biases)):
            with torch.no_grad():
                fused.qkv_weight = torch.cat([t.detach() for t in weights])
                if biases is not None:
                    fused.qkv_bias = torch.cat([t.detach() for t in biases])
            made += ["qkv_weight", "qkv_bias"]
    if gate_up is not None and fused.gate_up_weight is None and _plain(gate_up):
        with torch.no_grad():
            fused.gate_up_weight = torch.cat([t.detach() for t in gate_up])
        made.append("gate_up_weight")
    fused.copies += tuple(made)
    return bool(made)


def drop_copies(fused: Fused) -> None:
    """Forget the copies `copy_missing` made (the layer runs those projections apart again)."""
    for name in fused.copies:
        setattr(fused, name, None)
    fused.copies = ()
