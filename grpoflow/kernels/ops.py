"""The layer operations of the native forward, as pure-torch references.

These run on the CPU (the tests) and anywhere Triton is absent. `kernels.TritonOps` overrides the
same methods with fused Triton kernels on CUDA and is tested against this class. Roundings follow
transformers' modules (RMSNorm in float32 then cast, rotary products in the model dtype), so the
float32 path reproduces transformers' greedy decoding token for token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

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


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` multiplies `dtype` on `device` without host syncs: CUDA, bfloat16,
    compute capability 8.0 or later (9.x for torch before 2.9)."""
    if device.type != "cuda" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    major, _ = torch.cuda.get_device_capability(device)
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    return major == 9 or (major >= 8 and version >= (2, 9))


def grouped_product(
    x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, use_grouped_mm: bool | None = None
) -> torch.Tensor:
    """Rows x (S, K) sorted by expert, each times its expert's weight (E, K, N) -> (S, N); `ends`
    (E,) int32, each expert's end row. `torch._grouped_mm` where it runs (`use_grouped_mm` None:
    `grouped_mm_runs`), else a loop over the experts (which reads `ends` on the host)."""
    if grouped_mm_runs(x.device, x.dtype) if use_grouped_mm is None else use_grouped_mm:
        return torch._grouped_mm(x, weight, offs=ends)
    out = x.new_zeros((x.shape[0], weight.shape[-1]))
    for expert, rows in _expert_rows(ends):
        out[rows] = x[rows] @ weight[expert]
    return out


def grouped_weight_grad(
    grad: torch.Tensor,
    x: torch.Tensor,
    ends: torch.Tensor,
    num_experts: int,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """Each expert's grad_rows^T x_rows: grad (S, N) and x (S, K) sorted by expert -> (E, N, K);
    zero for an expert without rows (which `torch._grouped_mm` leaves unwritten on some GPUs:
    pytorch/pytorch#172439). Products as `grouped_product` runs them."""
    if grouped_mm_runs(x.device, x.dtype) if use_grouped_mm is None else use_grouped_mm:
        out = torch._grouped_mm(grad.t(), x, offs=ends)
        empty = torch.diff(ends, prepend=ends.new_zeros(1)) == 0
        return out.masked_fill_(empty[:, None, None], 0)
    out = x.new_zeros((num_experts, grad.shape[1], x.shape[1]))
    for expert, rows in _expert_rows(ends):
        out[expert] = grad[rows].T @ x[rows]
    return out


def _expert_rows(ends: torch.Tensor) -> Iterator[tuple[int, slice]]:
    """Each expert with rows and its rows, from each expert's end row (read on the host)."""
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            yield expert, slice(start, end)
        start = end


def grouped_grads(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    use_grouped_mm: bool | None,
    need: tuple[bool, bool] = (True, True),
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients for x and weight (E, N, K) of rows x sorted by expert through their experts'
    weights as `F.linear` takes them (`grouped_linear`), each only where `need` asks: grouped
    products as `grouped_product` runs them, the weight's zero for an expert without rows."""
    grad_x = grouped_product(grad, weight, ends, use_grouped_mm) if need[0] else None
    grad_weight = grouped_weight_grad(grad, x, ends, weight.shape[0], use_grouped_mm) if need[1] else None
    return grad_x, grad_weight


class _GroupedLinear(torch.autograd.Function):
    """`grouped_product` of rows and the experts' weights in `F.linear`'s layout (E, N, K), its
    backward as grouped products too: the weights' gradient zero for an expert without rows."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, use_grouped_mm: bool | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight, ends)
        ctx.use_grouped_mm = use_grouped_mm
        return grouped_product(x, weight.transpose(1, 2), ends, use_grouped_mm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, ends = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        grad_x, grad_weight = grouped_grads(grad.contiguous(), x, weight, ends, ctx.use_grouped_mm, need)
        return grad_x, grad_weight, None, None


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, use_grouped_mm: bool | None = None
) -> torch.Tensor:
    """Rows x (S, K) sorted by expert, each through its expert's weight (E, N, K) as `F.linear`
    takes it -> (S, N), with autograd; `ends` and `use_grouped_mm` as `grouped_product` takes them.
    Unlike torch's own backward of `torch._grouped_mm`, an expert without rows gets a zero gradient
    on every GPU (`grouped_weight_grad`)."""
    return _GroupedLinear.apply(x, weight, ends, use_grouped_mm)


def expert_order(chosen: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer's (token, slot) pairs sorted by expert: the stable order of `chosen` (T, k)
    flattened, and each expert's end in it (E,) int32, as grouped products take their offsets;
    on the device, no host sync."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    bounds = torch.arange(1, num_experts + 1, device=chosen.device, dtype=flat.dtype)
    return order, torch.searchsorted(flat[order], bounds, out_int32=True)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """Rotary embedding (rotate-half form), transformers' `x * cos + rotate_half(x) * sin` op for
    op: x (T, H, D) with cos, sin (T, D), or x (B, H, L, D) with cos, sin (B, L, D), in x's dtype;
    cos and sin take the heads' axis at `unsqueeze_dim`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(unsqueeze_dim) + rotated * sin.unsqueeze(unsqueeze_dim)


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
    def cached_prefill_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        prefix: CachedPrefix,
        scale: float,
        window: int,
    ) -> torch.Tensor:
        """A prefill's new tokens q (G, L, Hq, D) against their cached prefixes and themselves
        (`attend_cached_prefix`)."""
        return attend_cached_prefix(q, k_cache, v_cache, prefix, scale, window)

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


@dataclass(slots=True)
class CachedPrefix:
    """What every layer of a prefill over cached prefixes shares: each item's pages, the positions
    of its new tokens and its length in the cache, and (built at the first layer that needs them,
    then kept) the torch reference's gather indices, stored-slot mask and one visibility mask per
    distinct sliding window.

    pages (G, P) each item's blocks in order, padded with any block; query_positions (G, L) the
    positions of the new tokens (padding repeats the last); lengths (G,) tokens of each item in
    the cache.
    """

    pages: torch.Tensor
    query_positions: torch.Tensor
    lengths: torch.Tensor
    block_size: int
    gather: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def indices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(blocks (G, K), offsets (K,), stored (G, K, 1, 1)): where each item's K = P * block_size
        key slots lie in the cache, and which of them hold its tokens."""
        if self.gather is None:
            position = torch.arange(self.pages.shape[1] * self.block_size, device=self.pages.device)
            blocks = self.pages[:, position // self.block_size]
            stored = (position[None, :] < self.lengths[:, None])[:, :, None, None]
            self.gather = blocks, position % self.block_size, stored
        return self.gather

    def visible(self, window: int) -> torch.Tensor:
        """(G, 1, L, K) which key slots each new token attends to (window <= 0: no sliding window)."""
        mask = self.masks.get(window)
        if mask is None:
            position = torch.arange(self.pages.shape[1] * self.block_size, device=self.pages.device)
            queries = self.query_positions[:, :, None]
            mask = position[None, None, :] <= queries  # (G, L, K)
            if window > 0:
                mask &= position[None, None, :] > queries - window
            mask = self.masks[window] = mask[:, None]
        return mask


def attend_cached_prefix(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix: CachedPrefix,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Causal attention of each item's new tokens over its keys and values in the paged cache: a
    cached prefix and the new tokens themselves, stored before this is called.

    q (G, L, Hq, D) at `prefix.query_positions`; caches (num_blocks, Hkv, block_size, D).
    Returns (G, L, Hq, D).
    """
    blocks, offsets, stored = prefix.indices()
    keys = k_cache[blocks, :, offsets]  # (G, K, Hkv, D)
    values = v_cache[blocks, :, offsets]
    # padding pages and stale slots may hold anything, NaN included
    keys, values = keys.masked_fill(~stored, 0), values.masked_fill(~stored, 0)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=prefix.visible(window),
        scale=scale,
        enable_gqa=True,
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
    """`attend_cached_prefix` for one layer, its `CachedPrefix` built from the arguments: q
    (G, L, Hq, D) at `query_positions` (G, L); pages (G, P); lengths (G,). Returns (G, L, Hq, D)."""
    prefix = CachedPrefix(pages, query_positions, lengths, k_cache.shape[2])
    return attend_cached_prefix(q, k_cache, v_cache, prefix, scale, window)
