"""Causal grouped-query attention whose every query row is computed by the same arithmetic in a
training forward over whole sequences and in a decode step against the paged KV cache.

One kernel serves both. A program takes one KV head and as many consecutive queries of a row as
their query heads fit its tile's rows (`DECODE_ROWS` for one query a row, a decode step;
`FORWARD_ROWS` for several: nine of Qwen2-0.5B's seven heads a KV head), each tile row computed
from its own query alone by products, whose every element sums along the product's depth in one
order whatever the tile's height; each row's sum of weights is such a product too (a row
reduction's order would follow the tile's layout across threads). It walks the keys in blocks of
`BLOCK_N` from the sequence's first key, with the same online-softmax update; a block past a
query's own position is masked whole for its rows, which leaves their running maximum, sum and
values exactly as they were (a factor exp(0) = 1, weights exp(-inf) = 0). So the decode step's
rows (one query per sequence, keys read through the block table) equal the full forward's rows
at the same positions bit for bit. Queries of one sequence share each block of keys; queries of
different sequences in one program (packed rows, padding) take their keys one query at a time. A
full forward reads its keys as a paged cache of one page per sequence. Each query's sequence is
given by its position: a query at index t with position p attends keys t - p .. t of its row, which
covers left and right padding (padding's positions start over at 0) and sequences packed in one row.

The backward recomputes attention with torch's varlen flash attention over the rows' sequences
(`attention_for_gradients`; `scaled_dot_product_attention` on the CPU) and runs its backward: no
(L, L) matrix kept, no device sync per layer; the gradients are those of a forward that rounds
differently from this one, as ordinary training's are.

`paged_attention` runs the kernel for several queries per sequence over a paged cache (a prefill,
with or without a cached prefix). On the CPU without Triton's interpreter every entry point
attends a query at a time in torch (`batch_invariant_cpu`), with the same property.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from grpoflow.kernels import batch_invariant_cpu as cpu
from grpoflow.kernels.attention_block import attend_block
from grpoflow.kernels.recompute import is_recomputing
from grpoflow.kernels.varlen import VARLEN_PARAMETERS, flash_varlen

BLOCK_N = 64
"""Keys per step of the online softmax, from each sequence's first key."""
DECODE_ROWS = 16
"""The least tile height of one query a row: its query heads padded to it (or to the next power
of two)."""
FORWARD_ROWS = 64
"""The least tile height of several queries a row (a full forward, a prefill): as many queries as
their heads fill it share each block of keys."""
ATTENTION_WARPS = 4


@triton.jit(do_not_specialize=["page_size", "queries_per_row"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, starts_ptr, positions_ptr, out_ptr, scale, page_size,
    queries_per_row, stride_qb, stride_qt, stride_qh, stride_kp, stride_kh, stride_ks,
    stride_vp, stride_vh, stride_vs, stride_tb, stride_ob, stride_ot, stride_oh,
    GROUP: tl.constexpr, SLOTS: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Program (SLOTS consecutive queries of one row, KV head); tile row r holds query head
    # r % GROUP of query r // GROUP. Keys of logical index j live at storage index starts[query]
    # + j, in page table[row, index // page_size].
    per_row = tl.cdiv(queries_per_row, SLOTS)
    row = (tl.program_id(0) // per_row).to(tl.int64)
    first_t = (tl.program_id(0) % per_row) * SLOTS
    kv_head = tl.program_id(1)
    r = tl.arange(0, ROWS)
    slot = r // GROUP
    t = first_t + slot
    live = (slot < SLOTS) & (t < queries_per_row)
    query = row * queries_per_row + t
    position = tl.load(positions_ptr + query, mask=live, other=0).to(tl.int64)
    start = tl.load(starts_ptr + query, mask=live, other=0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    heads = (kv_head * GROUP + r % GROUP).to(tl.int64)
    q = tl.load(
        q_ptr + row * stride_qb + t[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=live[:, None],
        other=0.0,
    )
    m = tl.full([ROWS], -1e30, tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    first_start = tl.min(tl.where(live, start, 1 << 60))
    if first_start == tl.max(tl.where(live, start, -1)):  # one sequence: its keys read once
        last = tl.max(tl.where(live, position, -1))
        for first in range(0, last + 1, BLOCK_N):
            keys = first + tl.arange(0, BLOCK_N)
            k, v = _key_block(k_ptr, v_ptr, table_ptr, row, kv_head, first_start + keys, keys <= last,
                              page_size, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
                              stride_tb, HEAD_DIM)  # fmt: skip
            visible = live[:, None] & (keys[None, :] <= position[:, None])
            m, total, acc = attend_block(q, k, v, visible, m, total, acc, scale, IEEE, True)
    else:  # queries of several sequences (packed, or padding): one at a time
        for s in range(SLOTS):
            own = live & (slot == s)
            own_start = tl.max(tl.where(own, start, -1))
            own_last = tl.max(tl.where(own, position, -1))
            for first in range(0, own_last + 1, BLOCK_N):
                keys = first + tl.arange(0, BLOCK_N)
                k, v = _key_block(k_ptr, v_ptr, table_ptr, row, kv_head, own_start + keys, keys <= own_last,
                                  page_size, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh,
                                  stride_vs, stride_tb, HEAD_DIM)  # fmt: skip
                visible = own[:, None] & (keys[None, :] <= position[:, None])
                m, total, acc = attend_block(q, k, v, visible, m, total, acc, scale, IEEE, True)
    out = acc / tl.maximum(total, 1e-30)[:, None]
    tl.store(
        out_ptr + row * stride_ob + t[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=live[:, None],
    )


@triton.jit
def _key_block(
    k_ptr, v_ptr, table_ptr, row, kv_head, stored, valid, page_size, stride_kp, stride_kh, stride_ks,
    stride_vp, stride_vh, stride_vs, stride_tb, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The keys and values at storage indices `stored` of `row`'s pages (zeros where not `valid`)."""
    d = tl.arange(0, HEAD_DIM)
    page = tl.load(table_ptr + row * stride_tb + stored // page_size, mask=valid, other=0).to(tl.int64)
    slot = stored % page_size
    k = tl.load(
        k_ptr + page[:, None] * stride_kp + kv_head * stride_kh + slot[:, None] * stride_ks + d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    v = tl.load(
        v_ptr + page[:, None] * stride_vp + kv_head * stride_vh + slot[:, None] * stride_vs + d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    return k, v


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> int:
    """The query heads per KV head; k and v in either layout (B or pages, Hkv, ..., D)."""
    head_dim = q.shape[-1]
    if k.shape != v.shape or q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(
            f"attention needs keys and values of one shape and one dtype with the queries; got q "
            f"{q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}"
        )
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(
            f"attention needs query heads a multiple of KV heads ({num_heads} vs {num_kv_heads}) and a "
            f"power-of-two head dim of at least 16 (got {head_dim})"
        )
    return num_heads // num_kv_heads


def _launch(
    q, k, v, table, starts, positions, out, scale, page_size, queries_per_row, q_strides, out_strides,
    num_heads,
):  # fmt: skip
    group = _check_heads(q, k, v, num_heads)
    num_queries = positions.numel()
    if num_queries == 0:
        return
    rows = max(DECODE_ROWS if queries_per_row == 1 else FORWARD_ROWS, triton.next_power_of_2(group))
    slots = min(rows // group, triton.next_power_of_2(queries_per_row))  # queries sharing a tile
    programs = num_queries // queries_per_row * triton.cdiv(queries_per_row, slots)
    _attention_kernel[(programs, k.shape[1])](
        q, k, v, table, starts, positions, out, scale, page_size, queries_per_row, *q_strides,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), table.stride(0),
        *out_strides,
        GROUP=group, SLOTS=slots, ROWS=rows, HEAD_DIM=q.shape[-1], BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32, num_warps=ATTENTION_WARPS, num_stages=2,
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One new query per row against its paged context, the new token's key and value already in
    the cache (the native engine's layout).

    q (B, Hq, D); caches (num_blocks, Hkv, block_size, D); block_table (B, max_blocks) int;
    context_lens (B,) int, the new token included (0: an idle row, whose output is zeros).
    Returns (B, Hq, D), each row bit-identical to `attention`'s row at position context - 1.
    """
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("decode_attention needs a unit stride along the head dim of q and the caches")
    if block_table.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        raise ValueError(
            f"decode_attention needs a block table row and a context length per query row: q "
            f"{tuple(q.shape)}, block_table {tuple(block_table.shape)}, context_lens {tuple(context_lens.shape)}"
        )
    positions = context_lens.to(torch.int64) - 1
    if not cpu.triton_runs(q):  # with the kernel's refusals
        _check_heads(q, k_cache, v_cache, q.shape[1])
        return cpu.paged_rows(q[:, None], k_cache, v_cache, block_table, positions[:, None], scale)[:, 0]
    starts = torch.zeros_like(positions)
    out = torch.empty_like(q)
    _launch(
        q, k_cache, v_cache, block_table, starts, positions, out, scale, k_cache.shape[2], 1,
        (q.stride(0), 0, q.stride(1)), (out.stride(0), 0, out.stride(1)), q.shape[1],
    )  # fmt: skip
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Several queries per sequence against the sequence's keys in the paged cache, each query's
    own key and those before it already written there (a prefill, its cached prefix included).

    q (B, T, Hq, D); caches (num_blocks, Hkv, block_size, D); block_table (B, max_blocks) int;
    positions (B, T) int, each query's position in its sequence: it attends keys 0..position.
    Returns (B, T, Hq, D), each query bit-identical to `attention`'s row at its position.
    """
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention needs a unit stride along the head dim of q and the caches")
    if block_table.shape[0] != q.shape[0] or positions.shape != q.shape[:2]:
        raise ValueError(
            f"paged_attention needs a block table row per sequence and a position per query: q "
            f"{tuple(q.shape)}, block_table {tuple(block_table.shape)}, positions {tuple(positions.shape)}"
        )
    positions = positions.to(torch.int64).contiguous()
    if not cpu.triton_runs(q):  # with the kernel's refusals
        _check_heads(q, k_cache, v_cache, q.shape[2])
        return cpu.paged_rows(q, k_cache, v_cache, block_table, positions, scale)
    out = torch.empty_like(q)
    _launch(
        q, k_cache, v_cache, block_table, torch.zeros_like(positions), positions, out, scale,
        k_cache.shape[2], q.shape[1], (q.stride(0), q.stride(1), q.stride(2)),
        (out.stride(0), out.stride(1), out.stride(2)), q.shape[2],
    )  # fmt: skip
    return out


def sequence_starts(positions: torch.Tensor, length: int) -> torch.Tensor:
    """(B, L) positions -> (B, L) index of each query's first key: t - position[t]. A position past
    its index (a key before the row's first) is refused."""
    starts = torch.arange(length, device=positions.device) - positions
    if bool((starts < 0).any()):
        raise ValueError(
            "attention positions must not exceed their index in the row (position t - p is the "
            "sequence's first token); build them from the attention mask (padding counts from 0)"
        )
    return starts


_last_rows: list = []
"""[the positions tensor a call was given, its version and (B, L), its rows' (positions, starts),
their `_Sequences` or None until asked]: every layer of one forward, and of its backward, passes
the same positions, which are checked (a device sync) once."""


def _rows_of(
    positions: torch.Tensor, batch: int, length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) int64 positions on `device` and each query's first key (`sequence_starts`); the last
    call's, where it was given this very tensor unchanged."""
    key = (positions._version, batch, length, device)
    if _last_rows and _last_rows[0] is positions and _last_rows[1] == key:
        return _last_rows[2]
    expanded = positions.to(device=device, dtype=torch.int64).expand(batch, length).contiguous()
    rows = expanded, sequence_starts(expanded, length)
    _last_rows[:] = [positions, key, rows, None]
    return rows


class _Sequences(NamedTuple):
    """The sequences of (B, L) rows end to end: `bounds` (sequences + 1,) int32 on the device and
    the longest one's length; or `counts_up` False where positions do not count 0, 1, 2, ...
    within each sequence (then no sequence layout describes what each query attends)."""

    counts_up: bool
    plain: bool  # one sequence per row, from its first token (no padding, no packing)
    bounds: torch.Tensor | None
    max_length: int


def _sequences_of(positions: torch.Tensor, batch: int, length: int, device: torch.device) -> _Sequences:
    """`positions`' sequences (two device syncs, once per positions tensor as `_rows_of`)."""
    expanded, _ = _rows_of(positions, batch, length, device)
    if _last_rows[3] is not None:
        return _last_rows[3]
    flat = expanded.reshape(-1)
    if flat.numel() == 0:
        _last_rows[3] = _Sequences(True, True, flat.new_zeros(1, dtype=torch.int32), 0)
        return _last_rows[3]
    firsts = torch.nonzero(flat == 0).flatten()
    lengths = torch.diff(firsts, append=firsts.new_full((1,), flat.numel()))
    steps = flat[1:] - flat[:-1]
    counts_up = ((steps == 1) | (flat[1:] == 0)).all() & (expanded[:, 0] == 0).all()
    summary = torch.stack([counts_up.long(), lengths.max(), lengths.min()]).tolist()
    bounds = torch.cat([firsts, firsts.new_full((1,), flat.numel())]).to(torch.int32)
    plain = bool(summary[0]) and firsts.numel() == batch and summary[2] == length
    sequences = _Sequences(bool(summary[0]), plain, bounds, int(summary[1]))
    _last_rows[3] = sequences
    return sequences


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention over whole rows, no autograd (see `attention`). q (B, Hq, L, D), k and v
    (B, Hkv, L, D), positions (B, L) or (1, L) int -> (B, L, Hq, D)."""
    batch, _, length, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2] != length:
        raise ValueError(f"attention needs keys for every query: q {tuple(q.shape)}, k {tuple(k.shape)}")
    positions, starts = _rows_of(positions, batch, length, q.device)
    if not cpu.triton_runs(q):  # with the kernel's refusals
        _check_heads(q, k, v, q.shape[1])
        return cpu.attention_rows(q, k, v, positions, starts, scale)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    table = torch.arange(batch, device=q.device, dtype=torch.int32)[:, None]
    out = torch.empty((batch, length, q.shape[1], head_dim), dtype=q.dtype, device=q.device)
    _launch(
        q, k, v, table, starts, positions, out, scale, length, length,
        (q.stride(0), q.stride(2), q.stride(1)), (out.stride(0), out.stride(1), out.stride(2)), q.shape[1],
    )  # fmt: skip
    return out


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """`attention` in torch's `scaled_dot_product_attention`, differentiable (its backward)."""
    batch, _, length, _ = q.shape
    sequences = _sequences_of(positions, batch, length, q.device)
    if sequences.plain:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        _, starts = _rows_of(positions, batch, length, q.device)
        index = torch.arange(length, device=q.device)
        keys = index[None, None, :]
        mask = (keys <= index[None, :, None]) & (keys >= starts[:, :, None])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def attention_for_gradients(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """`attention` up to rounding, differentiable, fast: the backward's recompute and a
    checkpointed layer's. On CUDA, where the positions count up within each sequence, torch's
    varlen flash attention over the rows' sequences end to end; else `attention_reference`."""
    batch, num_heads, length, head_dim = q.shape
    sequences = _sequences_of(positions, batch, length, q.device)
    if not (q.is_cuda and sequences.counts_up and VARLEN_PARAMETERS):
        return attention_reference(q, k, v, positions, scale)
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], head_dim) for x in (q, k, v))
    out = flash_varlen(q, k, v, sequences.bounds, sequences.max_length, scale)
    return out.view(batch, length, num_heads, head_dim)


class _Attention(torch.autograd.Function):
    """The batch-invariant forward; the backward of `attention_for_gradients`, recomputed."""

    @staticmethod
    def forward(ctx, q, k, v, positions, scale):
        ctx.save_for_backward(q, k, v, positions)
        ctx.scale = scale
        if is_recomputing():  # a checkpointed layer's recompute: its outputs only feed the backward
            return attention_for_gradients(q, k, v, positions, scale)
        return attention_forward(q, k, v, positions, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, positions = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            out = attention_for_gradients(*inputs, positions, ctx.scale)
            grads = torch.autograd.grad(out, inputs, grad)
        return (*grads, None, None)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal grouped-query attention over whole rows whose every query row is bit-identical to
    `decode_attention`'s row for the same sequence and position.

    q (B, Hq, L, D), k and v (B, Hkv, L, D) (transformers' layout); positions (B, L) or (1, L):
    each token's position in its sequence (from 0 at the sequence's first token; padding's count
    from 0 too). Returns (B, L, Hq, D).
    """
    return _Attention.apply(q, k, v, positions, scale)
