"""`attn_implementation: grpoflow_varlen`: packed sequences attended with torch's variable-length
flash attention, no mask.

A padding-free micro-batch (`algo.packing`) is one row of sequences end to end. transformers keeps
them apart with a block-diagonal mask for `sdpa` (every block computed: attention costs as for one
sequence of the whole row) or with flash-attn's varlen kernels, which need the flash-attn package.
This implementation, registered with transformers' attention and mask interfaces, reads the
sequences' boundaries that `packed_sequence_logprobs` passes down (`cu_seq_lens_q`,
`max_length_q`: transformers' own names for them) and attends within each:

- on CUDA with `torch.nn.attention.varlen.varlen_attn` (flash attention over the packed tokens,
  causal, grouped-query heads shared);
- elsewhere one causal `scaled_dot_product_attention` per sequence (the CPU tests' path).

Any forward without boundaries (a padded batch, generation with a cache) runs transformers'
`sdpa` as it is, with `sdpa`'s masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpoflow.kernels.varlen import flash_varlen

NAME = "grpoflow_varlen"


def register() -> None:
    """Make `NAME` an attention implementation transformers models can be set to (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def varlen_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: Tensor | None = None,
    max_length_q: int | None = None,
    key_index: Tensor | None = None,
    cu_seq_lens_k: Tensor | None = None,
    max_length_k: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function interface: query (1, Hq, T, D), key and value
    (1, Hkv, T, D) -> ((1, T, Hq, D), None). Given `key_index` (keys,), each sequence's keys
    are those packed tokens, bounded by `cu_seq_lens_k`: a completion attends to its group's
    prompt, packed once, and to itself (`algo.shared_prompts`)."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"{NAME} takes one packed row, got a batch of {query.shape[0]}")
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # (T, H, D)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if key_index is not None:
        k, v = k.index_select(0, key_index), v.index_select(0, key_index)
    else:
        cu_seq_lens_k, max_length_k = None, None
    if q.is_cuda:
        to_int = dict(device=q.device, dtype=torch.int32)
        out = flash_varlen(
            q,
            k,
            v,
            cu_seq_lens_q.to(**to_int),
            int(max_length_q),
            scale,
            None if cu_seq_lens_k is None else cu_seq_lens_k.to(**to_int),
            None if max_length_k is None else int(max_length_k),
        )
    else:
        out = per_sequence_attention(q, k, v, cu_seq_lens_q, scale, cu_seq_lens_k)
    return out.unsqueeze(0), None


def per_sequence_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seq_lens: Tensor, scale: float, cu_seq_lens_k: Tensor | None = None
) -> Tensor:
    """Causal attention within each sequence of a packed row: q (T, Hq, D), k and v (Tk, Hkv, D),
    `cu_seq_lens` (sequences + 1,) the queries' boundaries and `cu_seq_lens_k` the keys' (None: the
    same); a sequence's queries are its last tokens; -> (T, Hq, D)."""
    bounds = cu_seq_lens.tolist()
    key_bounds = bounds if cu_seq_lens_k is None else cu_seq_lens_k.tolist()
    parts = []
    for start, stop, key_start, key_stop in zip(bounds[:-1], bounds[1:], key_bounds[:-1], key_bounds[1:]):
        q_i = q[start:stop].transpose(0, 1).unsqueeze(0)
        k_i, v_i = (t[key_start:key_stop].transpose(0, 1).unsqueeze(0) for t in (k, v))
        queries, keys = stop - start, key_stop - key_start
        mask = None
        if keys != queries:  # bottom-right causal: query i sees the keys up to its own position
            mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries)
        out = F.scaled_dot_product_attention(
            q_i, k_i, v_i, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        parts.append(out[0].transpose(0, 1))
    return torch.cat(parts)
