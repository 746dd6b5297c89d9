"""One matrix product for q/k/v and one for gate/up, over the policy's own parameters.

Decode steps are small: at 512 rows a Qwen2-0.5B layer's k and v products take ~4 us each, mostly
fixed cost, so three q/k/v products cost twice one fused product. `alias_rows` places the weights
of sibling projections back to back in one buffer (once, when the engine is built) by pointing each
parameter's `.data` at its slice: the parameters keep their identity, so optimizers, gradient
hooks and state dicts see no difference, and an optimizer step updates the fused buffer in place.
`rows_view` then finds the fused matrix on every refresh; when something has since given a
parameter new storage (`module.to`, FSDP), it returns None and the engine multiplies the
projections one by one, so speed may drop but the result never goes stale.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


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
