"""Triton kernels for the CUDA path; `TritonOps` swaps them in for the torch reference ops.

Imported only when the engine runs on CUDA with Triton. Each kernel is tested against its
reference in `ops.py` / `sampler.py` on the GPU (tests marked `gpu`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from grpoflow.algo.draw_kernels import hash32
from grpoflow.kernels.attention_block import attend_block
from grpoflow.kernels.ops import TorchOps
from grpoflow.kernels.prefill import paged_prefix_attention


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, num_cols, eps,
    HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * num_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * num_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * num_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inverse = tl.rsqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: (1 + weight) times the float32 norm, then one rounding
        out = (xf * inverse) * (1.0 + weight)
    else:
        out = weight * (xf * inverse).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * num_cols + cols, out.to(dtype), mask=mask)


@triton.jit
def _rotate_halves(x1, x2, cos, sin, dtype: tl.constexpr):
    # transformers' rotate-half rotary with its roundings: each product, then the sum, in dtype.
    out1 = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    return out1, out2


@triton.jit
def _head_norm(x1, x2, w1, w2, eps, HEAD_DIM: tl.constexpr, dtype: tl.constexpr):
    # Qwen3's per-head RMSNorm over the two halves (the last axis) of x, float32 statistics; w1, w2
    # the weight's halves in float32 (zero padding past the halves adds nothing to the sums).
    inverse = tl.rsqrt((tl.sum(x1 * x1, axis=-1) + tl.sum(x2 * x2, axis=-1)) / HEAD_DIM + eps)
    inverse = tl.expand_dims(inverse, -1)
    x1 = (w1 * (x1 * inverse).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    x2 = (w2 * (x2 * inverse).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return x1, x2


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
    q_weight_ptr, k_weight_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table,
    stride_cb, stride_ch, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    # One program per token: the query heads then the key heads as rows of one tile.
    token = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    d = tl.arange(0, HALF_PAD)[None, :]
    head = tl.arange(0, HEADS_PAD)[:, None]
    dmask = d < HALF
    is_query = (head < NUM_Q_HEADS) & dmask
    kv_head = head - NUM_Q_HEADS
    is_key = (head >= NUM_Q_HEADS) & (kv_head < NUM_KV_HEADS) & dmask
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + position * stride_table + d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_table + d, mask=dmask, other=0.0).to(tl.float32)
    q_base = q_ptr + token * stride_qt + head * stride_qh + d
    k_base = k_ptr + token * stride_kt + kv_head * stride_kh + d
    x1 = tl.load(q_base, mask=is_query, other=0.0).to(tl.float32)
    x1 += tl.load(k_base, mask=is_key, other=0.0).to(tl.float32)
    x2 = tl.load(q_base + HALF, mask=is_query, other=0.0).to(tl.float32)
    x2 += tl.load(k_base + HALF, mask=is_key, other=0.0).to(tl.float32)
    if HAS_NORM:
        q_w1 = tl.load(q_weight_ptr + d, mask=dmask, other=0.0).to(tl.float32)
        q_w2 = tl.load(q_weight_ptr + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        k_w1 = tl.load(k_weight_ptr + d, mask=dmask, other=0.0).to(tl.float32)
        k_w2 = tl.load(k_weight_ptr + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        w1 = tl.where(head < NUM_Q_HEADS, q_w1, k_w1)
        w2 = tl.where(head < NUM_Q_HEADS, q_w2, k_w2)
        x1, x2 = _head_norm(x1, x2, w1, w2, eps, 2 * HALF, dtype)
    out1, out2 = _rotate_halves(x1, x2, cos, sin, dtype)
    tl.store(q_base, out1, mask=is_query)
    tl.store(q_base + HALF, out2, mask=is_query)
    tl.store(k_base, out1, mask=is_key)
    tl.store(k_base + HALF, out2, mask=is_key)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        offset = (slot // BLOCK_SIZE) * stride_cb + kv_head * stride_ch + (slot % BLOCK_SIZE) * stride_cs + d
        tl.store(k_cache_ptr + offset, out1, mask=is_key)
        tl.store(k_cache_ptr + offset + HALF, out2, mask=is_key)
        v_base = v_ptr + token * stride_vt + kv_head * stride_vh + d
        tl.store(v_cache_ptr + offset, tl.load(v_base, mask=is_key, other=0.0), mask=is_key)
        tl.store(v_cache_ptr + offset + HALF, tl.load(v_base + HALF, mask=is_key, other=0.0), mask=is_key)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, num_cols, stride_gate, stride_up, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    dtype = gate_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * num_cols + cols, (activated * up).to(dtype), mask=mask)


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, q_weight_ptr, k_weight_ptr, eps,
    k_cache_ptr, v_cache_ptr, table_ptr, context_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    scale, window, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_rotary,
    stride_cb, stride_ch, stride_cs, stride_tb, stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_NORM: tl.constexpr, IEEE: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    # One program per (row, KV head, split of the context): norm and rotate the row's new query
    # heads and key, write the key and value into the cache (the first split), attend over its
    # share of the cached context, then fold in the new token from registers (the last split; it
    # is the context's last position), so nothing is read back that a program wrote. One split
    # writes the output; several write their running (max, sum, accumulator) for
    # `_combine_splits_kernel`.
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = q_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_ptr + row)
    g = tl.arange(0, GROUP_PAD)
    h = tl.arange(0, HALF)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None]
    q_base = q_ptr + row * stride_qb + heads[:, None] * stride_qh + h[None, :]
    q1 = tl.load(q_base, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_base + HALF, mask=q_mask, other=0.0).to(tl.float32)
    k_base = k_ptr + row * stride_kb + kv_head * stride_kh + h
    k1 = tl.load(k_base).to(tl.float32)
    k2 = tl.load(k_base + HALF).to(tl.float32)
    v_new = tl.load(v_ptr + row * stride_vb + kv_head * stride_vh + d)
    if HAS_NORM:
        q_w1, q_w2 = tl.load(q_weight_ptr + h).to(tl.float32), tl.load(q_weight_ptr + HALF + h).to(tl.float32)
        k_w1, k_w2 = tl.load(k_weight_ptr + h).to(tl.float32), tl.load(k_weight_ptr + HALF + h).to(tl.float32)
        q1, q2 = _head_norm(q1, q2, q_w1, q_w2, eps, HEAD_DIM, dtype)
        k1, k2 = _head_norm(k1, k2, k_w1, k_w2, eps, HEAD_DIM, dtype)
    position = tl.load(positions_ptr + row)
    cos = tl.load(cos_ptr + position * stride_rotary + h).to(tl.float32)  # the tables repeat their halves
    sin = tl.load(sin_ptr + position * stride_rotary + h).to(tl.float32)
    q1, q2 = _rotate_halves(q1, q2, cos[None, :], sin[None, :], dtype)
    k1, k2 = _rotate_halves(k1, k2, cos, sin, dtype)
    slot = tl.load(slots_ptr + row)
    if (slot >= 0) & (split == 0):
        offset = (slot // BLOCK_SIZE) * stride_cb + kv_head * stride_ch + (slot % BLOCK_SIZE) * stride_cs
        tl.store(k_cache_ptr + offset + h, k1)
        tl.store(k_cache_ptr + offset + HALF + h, k2)
        tl.store(v_cache_ptr + offset + d, v_new)
    # The new token's scores first, so that the halves are dead before the loop (registers bound
    # how many programs an SM holds, and with them how many loads are in flight).
    own = tl.sum(q1.to(tl.float32) * k1.to(tl.float32)[None, :], axis=1)
    own += tl.sum(q2.to(tl.float32) * k2.to(tl.float32)[None, :], axis=1)
    own = tl.where((context > 0) & (split == SPLITS - 1), own * scale, float("-inf"))
    q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (GROUP_PAD, HEAD_DIM))
    m = tl.full([GROUP_PAD], -1e30, tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    cached = context - 1
    start = tl.where(window > 0, tl.maximum(context - window, 0), 0)
    lowest = (start // BLOCK_N) * BLOCK_N
    share = (tl.maximum(cached - lowest, 0) + SPLITS - 1) // SPLITS
    chunk = ((share + BLOCK_N - 1) // BLOCK_N) * BLOCK_N  # whole blocks: no block spans two splits
    first_key = lowest + split * chunk
    for first in range(first_key, tl.minimum(first_key + chunk, cached), BLOCK_N):
        offs = first + tl.arange(0, BLOCK_N)
        valid = (offs < cached) & (offs >= start)
        page = tl.load(table_ptr + row * stride_tb + offs // BLOCK_SIZE, mask=offs < cached, other=0)
        offset = page.to(tl.int64)[:, None] * stride_cb + kv_head * stride_ch
        offset += (offs % BLOCK_SIZE)[:, None] * stride_cs + d[None, :]
        k = tl.load(k_cache_ptr + offset, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offset, mask=valid[:, None], other=0.0)
        m, total, acc = attend_block(q, k, v, valid[None, :], m, total, acc, scale, IEEE)
    m_new = tl.maximum(m, own)
    alpha = tl.exp(m - m_new)
    p = tl.exp(own - m_new)
    total = total * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
    if SPLITS == 1:
        out = acc / tl.maximum(total, 1e-30)[:, None]
        tl.store(
            out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:
        part = ((row * tl.num_programs(1) + kv_head) * SPLITS + split) * GROUP_PAD + g
        tl.store(part_m_ptr + part, m_new)
        tl.store(part_l_ptr + part, total)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc)


@triton.jit
def _combine_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    # One program per (row, KV head): the splits' running sums rescaled to their common max.
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    base = (row * tl.num_programs(1) + kv_head) * SPLITS
    m = tl.full([GROUP_PAD], -1e30, tl.float32)
    for split in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(part_m_ptr + (base + split) * GROUP_PAD + g))
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for split in tl.static_range(SPLITS):
        part = (base + split) * GROUP_PAD + g
        weight = tl.exp(tl.load(part_m_ptr + part) - m)
        total += tl.load(part_l_ptr + part) * weight
        acc += tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :]) * weight[:, None]
    out = acc / tl.maximum(total, 1e-30)[:, None]
    heads = kv_head * GROUP + g
    tl.store(
        out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(g < GROUP)[:, None],
    )


@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, keys_ptr, thresholds_ptr, tokens_ptr, logprobs_ptr, vocab_size, inverse_temperature,
    GREEDY: tl.constexpr, HAS_THRESHOLD: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):  # fmt: skip
    # Inversion sampling in one program per row. Pass 1 streams the logits once: each lane keeps a
    # running max and softmax sum (one exp per token), and at the end of every chunk of CHUNK blocks
    # the lanes are reduced into the allowed mass of the prefix up to there. The uniform picks the
    # chunk where the cumulative mass crosses it; pass 2 rereads that chunk alone and finds the
    # token with a cumulative sum. Greedy rows keep each lane's best logit instead.
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * stride_row
    threshold = float("-inf")
    if HAS_THRESHOLD:
        threshold = tl.load(thresholds_ptr + row)
    lanes = tl.arange(0, BLOCK)
    chunk_ids = tl.arange(0, NUM_CHUNKS)
    lane_max = tl.full([BLOCK], -1e30, tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    lane_mass = tl.zeros([BLOCK], tl.float32)  # the allowed part of lane_sum (filters only)
    lane_best = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_index = tl.full([BLOCK], 2147483647, tl.int32)
    prefix_max = tl.full([NUM_CHUNKS], -1e30, tl.float32)
    prefix_mass = tl.zeros([NUM_CHUNKS], tl.float32)
    num_chunks = tl.cdiv(vocab_size, BLOCK * CHUNK)
    for chunk in range(0, num_chunks):
        for block in range(0, CHUNK):
            offs = (chunk * CHUNK + block) * BLOCK + lanes
            mask = offs < vocab_size
            x = (
                tl.load(row_logits + offs, mask=mask, other=float("-inf")).to(tl.float32)
                * inverse_temperature
            )
            delta = x - lane_max
            rises = delta > 0
            shrink = tl.exp(-tl.abs(delta))  # exp(old max - x) when x is the new max, else exp(x - max)
            lane_sum = tl.where(rises, lane_sum * shrink + 1.0, lane_sum + shrink)
            if HAS_THRESHOLD:
                allowed = (mask & (x >= threshold)).to(tl.float32)
                lane_mass = tl.where(rises, lane_mass * shrink + allowed, lane_mass + allowed * shrink)
            lane_max = tl.maximum(lane_max, x)
            if GREEDY:
                better = mask & (x > lane_best)
                if HAS_THRESHOLD:
                    better = better & (x >= threshold)
                lane_best = tl.where(better, x, lane_best)
                lane_index = tl.where(better, offs, lane_index)
        if not GREEDY:
            running_max = tl.max(lane_max, axis=0)
            if HAS_THRESHOLD:
                mass = tl.sum(lane_mass * tl.exp(lane_max - running_max), axis=0)
            else:
                mass = tl.sum(lane_sum * tl.exp(lane_max - running_max), axis=0)
            prefix_max = tl.where(chunk_ids == chunk, running_max, prefix_max)
            prefix_mass = tl.where(chunk_ids == chunk, mass, prefix_mass)
    row_max = tl.max(lane_max, axis=0)
    log_total = tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0))
    if GREEDY:
        best = tl.max(lane_best, axis=0)
        token = tl.min(tl.where(lane_best == best, lane_index, 2147483647), axis=0)  # the first, as argmax
    else:
        prefix = prefix_mass * tl.exp(prefix_max - row_max)  # the cumulative allowed mass at each chunk's end
        bits = hash32(tl.load(keys_ptr + row).to(tl.uint32) ^ tl.full([], 0x9E3779B1, tl.uint32))
        target = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        kept_mass = tl.sum(tl.where(chunk_ids == num_chunks - 1, prefix, 0.0), axis=0)
        target = target * kept_mass
        if HAS_THRESHOLD:  # the log-prob under the distribution drawn from: renormalised over the kept
            log_total = tl.log(kept_mass)
        below = (chunk_ids < num_chunks) & (prefix <= target)
        chosen = tl.minimum(tl.sum(below.to(tl.int32), axis=0), num_chunks - 1)
        running = tl.sum(tl.where(chunk_ids == chosen - 1, prefix, 0.0), axis=0)
        found = tl.full([], 2147483647, tl.int32)
        last = tl.full([], -1, tl.int32)
        for block in range(0, CHUNK):
            offs = (chosen * CHUNK + block) * BLOCK + lanes
            mask = offs < vocab_size
            x = (
                tl.load(row_logits + offs, mask=mask, other=float("-inf")).to(tl.float32)
                * inverse_temperature
            )
            weight = tl.exp(x - row_max)
            if HAS_THRESHOLD:
                weight = tl.where(x >= threshold, weight, 0.0)
            cumulative = tl.cumsum(weight, axis=0) + running
            crossed = (cumulative > target) & (weight > 0)
            found = tl.minimum(found, tl.min(tl.where(crossed, offs, 2147483647), axis=0))
            last = tl.maximum(last, tl.max(tl.where(weight > 0, offs, -1), axis=0))
            running += tl.sum(weight, axis=0)
        token = tl.where(found < 2147483647, found, last)  # last: a target rounded past the chunk's sum
        if token < 0:  # the chunk's mass rounded to nothing: the top token, which every filter keeps
            token = _first_max(row_logits, vocab_size, BLOCK)
    logit = tl.load(row_logits + token).to(tl.float32) * inverse_temperature
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, logit - row_max - log_total)


@triton.jit
def _first_max(row_logits, vocab_size, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    lane_best = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_index = tl.full([BLOCK], 2147483647, tl.int32)
    for first in range(0, vocab_size, BLOCK):
        offs = first + lanes
        x = tl.load(row_logits + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        better = x > lane_best
        lane_best = tl.where(better, x, lane_best)
        lane_index = tl.where(better, offs, lane_index)
    best = tl.max(lane_best, axis=0)
    return tl.min(tl.where(lane_best == best, lane_index, 2147483647), axis=0)


def sample_rows(
    logits: torch.Tensor,
    keys: torch.Tensor,
    inverse_temperature: float,
    greedy: bool,
    thresholds: torch.Tensor | None,
    tokens_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused sampler: `sampler.sample_reference` in one pass over logits (B, V); the tokens
    go into `tokens_out` (B,) int64 when given."""
    rows, vocab_size = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device) if tokens_out is None else tokens_out
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    block = min(2048, triton.next_power_of_2(vocab_size))
    num_chunks = 32
    chunk = triton.cdiv(triton.cdiv(vocab_size, block), num_chunks)
    _sample_kernel[(rows,)](
        logits, logits.stride(0), keys, thresholds if thresholds is not None else keys, tokens, logprobs,
        vocab_size, inverse_temperature,
        GREEDY=greedy, HAS_THRESHOLD=thresholds is not None, BLOCK=block, CHUNK=chunk, NUM_CHUNKS=num_chunks,
        num_warps=8,
    )  # fmt: skip
    return tokens, logprobs


class TritonOps(TorchOps):
    """The reference ops with the hot ones replaced by Triton kernels."""

    name = "triton"

    cached_prefill_attention = staticmethod(paged_prefix_attention)

    @staticmethod
    def rms_norm(
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        unit_offset: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x and residual (T, H) contiguous."""
        rows, cols = x.shape
        out = torch.empty_like(x)
        residual_out = torch.empty_like(x) if residual is not None else x
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, residual_out, cols, eps,
            HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=triton.next_power_of_2(cols),
            num_warps=8,
        )  # fmt: skip
        return out, residual_out

    @staticmethod
    def rope_and_store(q, k, v, cos, sin, positions, slots, k_cache, v_cache, qk_norm=None) -> None:
        tokens, num_q_heads, head_dim = q.shape
        half = head_dim // 2
        q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
        num_kv_heads = k.shape[1]
        _rope_store_kernel[(tokens,)](
            q, k, v, cos, sin, positions, slots, k_cache, v_cache, q_weight, k_weight, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
            HEADS_PAD=triton.next_power_of_2(num_q_heads + num_kv_heads), HALF=half,
            HALF_PAD=triton.next_power_of_2(half), BLOCK_SIZE=k_cache.shape[2], HAS_NORM=qk_norm is not None,
            num_warps=2,
        )  # fmt: skip

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate and up (T, I) may be row-strided views (halves of one fused product)."""
        rows, cols = gate.shape
        assert gate.stride(1) == 1 and up.stride(1) == 1, "silu_mul needs unit column stride"
        out = torch.empty((rows, cols), dtype=gate.dtype, device=gate.device)
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](
            gate, up, out, cols, gate.stride(0), up.stride(0), BLOCK=block, num_warps=4
        )
        return out

    @staticmethod
    def decode_layer_attention(q, k, v, k_cache, v_cache, batch, scale, window, qk_norm=None, splits=None):
        """`splits`: programs per (row, KV head), each over a share of the context (None: as
        `decode_splits` chooses for the rows)."""
        rows, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        group_pad = max(16, triton.next_power_of_2(group))
        splits = splits or decode_splits(rows * num_kv_heads, q.device)
        q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
        out = torch.empty_like(q)
        parts = (rows * num_kv_heads * splits * group_pad,) if splits > 1 else (1,)
        part_m, part_l = torch.empty(parts, device=q.device), torch.empty(parts, device=q.device)
        part_acc = torch.empty((parts[0], head_dim) if splits > 1 else (1,), device=q.device)
        _decode_attention_kernel[(rows, num_kv_heads, splits)](
            q, k, v, batch.cos, batch.sin, batch.positions, batch.slots, q_weight, k_weight, eps,
            k_cache, v_cache, batch.block_table, batch.context_lens, out, part_m, part_l, part_acc,
            scale, window, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            batch.cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            batch.block_table.stride(0), out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
            BLOCK_SIZE=k_cache.shape[2], BLOCK_N=64, HAS_NORM=qk_norm is not None,
            IEEE=q.dtype == torch.float32, SPLITS=splits, num_warps=4, num_stages=2,
            # Capped registers let more programs share an SM, and with them more loads in flight: on
            # an H100 with 64-wide heads, 88 -> 64 made a decode step about 3% faster (a few spills).
            maxnreg=64 if head_dim <= 64 else None,
        )  # fmt: skip
        if splits > 1:
            _combine_splits_kernel[(rows, num_kv_heads)](
                part_m, part_l, part_acc, out, out.stride(0), out.stride(1),
                GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, SPLITS=splits, num_warps=4,
            )  # fmt: skip
        return out


PROGRAMS_PER_SM = 2
"""Decode-attention programs per multiprocessor below which a step splits each row's context:
one program per (row, KV head) streams its whole context alone, so few rows over long contexts
leave the GPU waiting on memory. On an H200, one layer of the Qwen2-0.5B shape timed in a CUDA
graph: 40 rows of 1,100 tokens 22.1 -> 11.5 us (7 splits), 128 rows of 900 31.0 -> 24.9 us
(3 splits), 256 rows of 640 28.5 -> 31.7 us (2 splits: enough programs already)."""
MAX_SPLITS = 16


def decode_splits(programs: int, device: torch.device) -> int:
    """Splits of each (row, KV head)'s context for a decode step of `programs` of them: enough to
    give every multiprocessor PROGRAMS_PER_SM programs, at most MAX_SPLITS; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    wanted = PROGRAMS_PER_SM * _multiprocessors(device.index or 0)
    return 1 if programs >= wanted else min(MAX_SPLITS, -(-wanted // programs))


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
