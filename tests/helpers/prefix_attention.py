"""Random prefills over cached prefixes, to check the Triton paged-prefix attention against the
torch reference (on CUDA, or on the CPU through Triton's interpreter)."""

from __future__ import annotations

import math

import torch

from grpoflow.kernels.ops import CachedPrefix, cached_prefill_attention

# (items, query heads per KV head, KV heads, head dim, block size, window, longest item)
CASES = [
    (5, 1, 2, 64, 16, 0, 150),
    (4, 7, 2, 64, 16, 0, 130),
    (3, 2, 1, 32, 8, 37, 160),
    (4, 4, 2, 64, 32, 5, 90),
]


def prefix_case(case, dtype, device, generator):
    """q (G, L, Hq, D) as a strided view, caches with NaN in every slot no item holds, the
    `CachedPrefix`, and each item's count of new tokens; prefixes of any length (0, unaligned)."""
    items, group, kv_heads, dim, block_size, window, longest = case
    lengths = torch.randint(1, longest + 1, (items,), generator=generator)
    lengths[0] = longest
    starts = (torch.rand(items, generator=generator) * lengths).long().clamp(max=lengths - 1)
    starts[-1] = 0  # an item with no cached prefix
    new = lengths - starts
    needed = [math.ceil(length / block_size) for length in lengths.tolist()]
    order = torch.randperm(sum(needed) + 3, generator=generator)
    pages = torch.zeros(items, max(needed), dtype=torch.int64)
    taken = 0
    for item, count in enumerate(needed):
        pages[item, :count] = order[taken : taken + count]
        taken += count
    shape = (sum(needed) + 3, kv_heads, block_size, dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    for item, length in enumerate(lengths.tolist()):
        position = torch.arange(length)
        blocks, offsets = pages[item, position // block_size], position % block_size
        k_cache[blocks, :, offsets] = torch.randn(length, kv_heads, dim, generator=generator)
        v_cache[blocks, :, offsets] = torch.randn(length, kv_heads, dim, generator=generator)
    num_queries = int(new.max())
    positions = torch.minimum(starts[:, None] + torch.arange(num_queries)[None, :], lengths[:, None] - 1)
    fused = torch.randn(items, num_queries, group * kv_heads + 2, dim, generator=generator)
    q = fused[:, :, 1 : 1 + group * kv_heads].to(device=device, dtype=dtype)  # not contiguous
    k_cache, v_cache = (cache.to(device=device, dtype=dtype) for cache in (k_cache, v_cache))
    prefix = CachedPrefix(pages.to(device), positions.to(device), lengths.to(device), block_size)
    return q, k_cache, v_cache, prefix, new, window


def check_paged_prefix_attention(device: str, dtype: torch.dtype, tolerance: float, seed: int = 0) -> None:
    """Every case's new tokens get the reference's output; every output (padding rows included) is
    finite."""
    from grpoflow.kernels.prefill import paged_prefix_attention

    generator = torch.Generator().manual_seed(seed)
    for case in CASES:
        q, k_cache, v_cache, prefix, new, window = prefix_case(case, dtype, device, generator)
        scale = q.shape[-1] ** -0.5
        out = paged_prefix_attention(q, k_cache, v_cache, prefix, scale, window)
        expected = cached_prefill_attention(
            q, k_cache, v_cache, prefix.pages, prefix.query_positions, prefix.lengths, scale, window
        )
        assert out.shape == expected.shape and torch.isfinite(out).all(), case
        for item, count in enumerate(new.tolist()):
            got, want = out[item, :count].double(), expected[item, :count].double()
            error = ((got - want).norm() / want.norm()).item()
            assert error < tolerance, (case, item, error)
