"""Causal attention over packed sequences with torch's variable-length flash attention
(`torch.nn.attention.varlen.varlen_attn`, CUDA), whichever of its signatures is installed."""

from __future__ import annotations

import inspect

from torch import Tensor


def _varlen_parameters() -> frozenset[str]:
    """The installed `varlen_attn`'s parameter names (none where torch has no varlen attention)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


VARLEN_PARAMETERS = _varlen_parameters()
"""Read once at import: not at every layer, and not inside a compiled region."""


def flash_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seq_lens: Tensor,
    max_length: int,
    scale: float,
    cu_seq_lens_k: Tensor | None = None,
    max_length_k: int | None = None,
) -> Tensor:
    """Causal attention within each sequence of packed tokens: q (T, Hq, D), k and v (T, Hkv, D),
    `cu_seq_lens` (sequences + 1,) int32 boundaries on q's device -> (T, Hq, D), differentiable.
    Keys may be laid out apart from the queries (`cu_seq_lens_k`, `max_length_k`): a sequence with
    more keys than queries is aligned to its last key (its queries are its last tokens), as flash
    attention aligns a causal mask. The first signature has `is_causal`, no scale and no grouped
    heads; the later `scale` and `window_size`, grouped heads natively (flagged by `enable_gqa`
    where it has one)."""
    from torch.nn.attention.varlen import varlen_attn

    parameters = VARLEN_PARAMETERS
    cu_k = cu_seq_lens if cu_seq_lens_k is None else cu_seq_lens_k
    max_k = max_length if max_length_k is None else max_length_k
    groups = q.shape[1] // k.shape[1]
    if "window_size" in parameters:
        options: dict = {"scale": scale, "window_size": (-1, 0)}
        if "enable_gqa" in parameters:
            options["enable_gqa"] = groups > 1
        return varlen_attn(q, k, v, cu_seq_lens, cu_k, max_length, max_k, **options)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    default = q.shape[-1] ** -0.5
    if scale != default:
        q = q * (scale / default)
    return varlen_attn(q, k, v, cu_seq_lens, cu_k, max_length, max_k, is_causal=True)
