"""Paged-prefix prefill attention in Triton: the CUDA path of `ops.attend_cached_prefix`.

A prefill whose items continue cached prefixes (a multi-turn episode's next turn) attends each
new token over the item's keys and values in the paged cache. Each program takes a tile of one
item's new tokens and the query heads of one KV head, and walks the item's cache block by block
through its page table: causal by position, an optional sliding window, an online softmax in
float32. Nothing is gathered and no mask is built, so a layer costs one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpoflow.kernels.attention_block import attend_block
from grpoflow.kernels.ops import CachedPrefix

TILE_ROWS = 64
"""Query rows of a program's tile: tokens times the padded query heads of one KV head."""


@triton.jit
def _prefix_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, pages_ptr, positions_ptr, lengths_ptr, out_ptr, scale, window,
    num_queries, stride_qg, stride_ql, stride_qh, stride_cb, stride_ch, stride_cs, stride_pg, stride_xg,
    stride_og, stride_ol, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Tile row i is token tile * BLOCK_M + i // GROUP_PAD and query head kv_head * GROUP + i % GROUP_PAD.
    tile = tl.program_id(0)
    item = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)
    i = tl.arange(0, BLOCK_M * GROUP_PAD)
    token = tile * BLOCK_M + i // GROUP_PAD
    member = i % GROUP_PAD
    head = kv_head * GROUP + member
    rows = (token < num_queries) & (member < GROUP)
    d = tl.arange(0, DIM_PAD)
    dmask = d < HEAD_DIM
    q_offset = item * stride_qg + token[:, None] * stride_ql + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offset, mask=rows[:, None] & dmask[None, :], other=0.0)
    position = tl.load(positions_ptr + item * stride_xg + token, mask=token < num_queries, other=0)
    length = tl.load(lengths_ptr + item)
    new_tokens = length - tl.load(positions_ptr + item * stride_xg)  # padding past them repeats the last
    lowest = tl.min(tl.where(rows, position, 1 << 30), axis=0)
    highest = tl.max(tl.where(rows, position, -1), axis=0)
    # a tile of padding rows alone attends to nothing (its output is zero)
    end = tl.where(tile * BLOCK_M < new_tokens, tl.minimum(highest + 1, length), 0)
    start = tl.where(window > 0, tl.maximum(lowest - window + 1, 0), 0)
    m = tl.full([BLOCK_M * GROUP_PAD], -1e30, tl.float32)
    total = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, DIM_PAD], tl.float32)
    for first in range((start // BLOCK_N) * BLOCK_N, end, BLOCK_N):
        offs = first + tl.arange(0, BLOCK_N)
        inside = offs < end
        page = tl.load(pages_ptr + item * stride_pg + offs // BLOCK_SIZE, mask=inside, other=0)
        offset = page.to(tl.int64)[:, None] * stride_cb + kv_head * stride_ch
        offset += (offs % BLOCK_SIZE)[:, None] * stride_cs + d[None, :]
        kv_mask = inside[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + offset, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offset, mask=kv_mask, other=0.0)
        visible = inside[None, :] & (offs[None, :] <= position[:, None])
        visible &= (window <= 0) | (offs[None, :] > position[:, None] - window)
        m, total, acc = attend_block(q, k, v, visible, m, total, acc, scale, IEEE)
    out = acc / tl.maximum(total, 1e-30)[:, None]
    out_offset = item * stride_og + token[:, None] * stride_ol + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + out_offset, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] & dmask[None, :])


def paged_prefix_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix: CachedPrefix,
    scale: float,
    window: int,
) -> torch.Tensor:
    """`ops.attend_cached_prefix` in one kernel: q (G, L, Hq, D) (any strides but a unit last one)
    at `prefix.query_positions`; caches (num_blocks, Hkv, block_size, D). Returns (G, L, Hq, D);
    the padding rows of an item are computed as its last token where they share a tile with its
    new tokens, and are zero in tiles of their own."""
    items, queries, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError(
            "paged_prefix_attention needs q with a unit last stride and two caches laid out alike; "
            "pass contiguous tensors"
        )
    pages, positions = prefix.pages.contiguous(), prefix.query_positions.contiguous()
    out = torch.empty(items, queries, num_heads, head_dim, dtype=q.dtype, device=q.device)
    group_pad = triton.next_power_of_2(group)
    block_m = max(1, TILE_ROWS // group_pad)
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    grid = (triton.cdiv(queries, block_m), items, num_kv_heads)
    _prefix_attention_kernel[grid](
        q, k_cache, v_cache, pages, positions, prefix.lengths, out, scale, window,
        queries, q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        pages.stride(0), positions.stride(0), out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=k_cache.shape[2], BLOCK_N=64 if dim_pad <= 128 else 32, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out
