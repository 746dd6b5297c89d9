"""The layer operations of the native forward, as pure-torch references.

These run on the CPU (the tests) and anywhere Triton is absent. `kernels.TritonOps` overrides the
same methods with fused Triton kernels on CUDA and is tested against this class. Roundings follow
transformers' modules (RMSNorm in float32 then cast, rotary products in the model dtype), so the
float32 path reproduces transformers' greedy decoding token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """transformers' RMSNorm over the last dim: float32 statistics, weight applied in x's dtype;
    with `unit_offset` (Gemma), `1 + weight` applied in float32 and the product cast to x's dtype."""
    dtype = x.dtype
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (hidden * (1.0 + weight.float())).to(dtype)
    return weight * hidden.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form). x (T, H, D); cos, sin (T, D) in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


@dataclass(slots=True)
class DecodeBatch:
    """What every layer of one decode step shares: one new token per row, at the row's last
    context position (`context_lens == positions + 1`; 0 for an idle row, whose slot is -1)."""

    cos: torch.Tensor  # (max_len, D) rotary tables in the model dtype
    sin: torch.Tensor
    positions: torch.Tensor  # (B,) int
    slots: torch.Tensor  # (B,) int, -1: no cache write
    block_table: torch.Tensor  # (B, max_blocks) int32
    context_lens: torch.Tensor  # (B,) int
    max_context: int  # an upper bound of context_lens (the torch reference sizes its gather by it)


class TorchOps:
    """Reference implementations; every method works on CPU and CUDA tensors."""

    name = "torch"

    @staticmethod
    def rms_norm(
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        unit_offset: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused residual add and RMSNorm. x, residual (T, H) -> (normed, x + residual);
        `unit_offset`: Gemma's norm (see `rms_norm_reference`)."""
        if residual is not None:
            x = x + residual
        return rms_norm_reference(x, weight, eps, unit_offset), x

    @staticmethod
    def rope_and_store(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> None:
        """Per-head norm (Qwen3), rotary in place on q (T, Hq, D) and k (T, Hkv, D), then k and v
        into the paged cache (num_blocks, Hkv, block_size, D) at `slots` (T,), where -1 skips."""
        if qk_norm is not None:
            q_weight, k_weight, eps = qk_norm
            q.copy_(rms_norm_reference(q, q_weight, eps))
            k.copy_(rms_norm_reference(k, k_weight, eps))
        cos_t, sin_t = cos[positions], sin[positions]
        q.copy_(rotate(q, cos_t, sin_t))
        k.copy_(rotate(k, cos_t, sin_t))
        valid = slots >= 0
        block_size = k_cache.shape[2]
        blocks, offsets = slots[valid] // block_size, slots[valid] % block_size
        k_cache[blocks, :, offsets] = k[valid]
        v_cache[blocks, :, offsets] = v[valid]

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's `silu(gate) * up`, each rounded to the dtype as transformers does."""
        return F.silu(gate) * up

    @staticmethod
    def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Gemma's `gelu_pytorch_tanh(gate) * up`, each rounded to the dtype as transformers does."""
        return F.gelu(gate, approximate="tanh") * up

    @classmethod
    def decode_layer_attention(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        window: int,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """One decode layer's attention from the q/k/v projections: per-head norm and rotary,
        the new k and v into the cache, then each row's query against its context.
        q (B, Hq, D), k and v (B, Hkv, D) -> (B, Hq, D); q and k are rotated in place."""
        cls.rope_and_store(
            q, k, v, batch.cos, batch.sin, batch.positions, batch.slots, k_cache, v_cache, qk_norm
        )
        return cls.decode_attention(
            q, k_cache, v_cache, batch.block_table, batch.context_lens, scale, window, batch.max_context
        )

    @staticmethod
    def decode_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int,
        max_context: int,
    ) -> torch.Tensor:
        """One query token per row against its paged context.

        q (B, Hq, D); caches (num_blocks, Hkv, block_size, D); block_table (B, max_blocks) int;
        context_lens (B,) int (0 for an idle row); window <= 0 means no sliding window.
        Returns (B, Hq, D); idle rows get finite garbage.
        """
        block_size = k_cache.shape[2]
        position = torch.arange(max(max_context, 1), device=q.device)
        pages = block_table[:, position // block_size].long()  # (B, L)
        offsets = position % block_size
        keys = k_cache[pages, :, offsets].permute(0, 2, 1, 3)  # (B, Hkv, L, D)
        values = v_cache[pages, :, offsets].permute(0, 2, 1, 3)
        visible = position[None, :] < context_lens[:, None]
        if window > 0:
            visible &= position[None, :] >= context_lens[:, None] - window
        visible[:, 0] |= context_lens == 0
        hidden = ~visible[:, None, :, None]  # stale cache memory may hold anything, NaN included
        keys, values = keys.masked_fill(hidden, 0), values.masked_fill(hidden, 0)
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],
            keys,
            values,
            attn_mask=visible[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return out[:, :, 0, :]


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int
) -> torch.Tensor:
    """Causal attention over right-padded prompts (padding sees only itself and what precedes it).

    q (G, L, Hq, D), k and v (G, L, Hkv, D) -> (G, L, Hq, D).
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    mask = None
    if window > 0:
        position = torch.arange(q.shape[2], device=q.device)
        distance = position[:, None] - position[None, :]
        mask = (distance >= 0) & (distance < window)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def cached_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    query_positions: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Causal attention of each item's new tokens over its keys and values in the paged cache: a
    cached prefix and the new tokens themselves, stored before this is called.

    q (G, L, Hq, D) at `query_positions` (G, L) (padding repeats the last position); caches
    (num_blocks, Hkv, block_size, D); pages (G, P) each item's blocks in order, padded with any
    block; lengths (G,) tokens of each item in the cache. Returns (G, L, Hq, D).
    """
    block_size = k_cache.shape[2]
    position = torch.arange(pages.shape[1] * block_size, device=q.device)
    blocks = pages[:, position // block_size]  # (G, K)
    keys = k_cache[blocks, :, position % block_size]  # (G, K, Hkv, D)
    values = v_cache[blocks, :, position % block_size]
    stored = (position[None, :] < lengths[:, None])[:, :, None, None]
    # padding pages and stale slots may hold anything, NaN included
    keys, values = keys.masked_fill(~stored, 0), values.masked_fill(~stored, 0)
    visible = position[None, None, :] <= query_positions[:, :, None]  # (G, L, K)
    if window > 0:
        visible &= position[None, None, :] > query_positions[:, :, None] - window
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)
