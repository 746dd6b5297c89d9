"""The Triton kernel of `draws.gumbel_draw` on CUDA: one pass over a row's logits that hashes each
token's Gumbel noise in registers, keeps the best noisy score and an online logsumexp of the kept
tokens.

The torch path makes a `(rows, vocab)` int64 noise tensor through a dozen elementwise passes; for a
152K vocabulary that is milliseconds per decode step, this is the logits read once. The hashes are
the torch path's bit for bit, so both draw the same token but where `log` rounds differently next
to a tie. The engine and the trainer's replay both run this kernel on CUDA, so their noise is
identical. Imported only on CUDA with Triton; `tests/algo/test_draw_kernels_interpreted.py` checks it
against the torch path in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def hash32(x):
    """lowbias32 on uint32 lanes (`draws.hash32_torch` bit for bit); the engine's sampler uses it too."""
    x ^= x >> 16
    x *= tl.full([], 0x7FEB352D, tl.uint32)
    x ^= x >> 15
    x *= tl.full([], 0x846CA68B, tl.uint32)
    x ^= x >> 16
    return x


@triton.jit
def _gumbel_kernel(
    logits_ptr, stride_row, keys_ptr, thresholds_ptr, tokens_ptr, logprobs_ptr, vocab_size,
    inverse_temperature, HAS_THRESHOLD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * stride_row
    lanes = tl.arange(0, BLOCK)
    row_hash = hash32(tl.load(keys_ptr + row).to(tl.uint32) ^ tl.full([], 0x9E3779B1, tl.uint32))
    threshold = tl.load(thresholds_ptr + row) if HAS_THRESHOLD else float("-inf")
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], 2147483647, tl.int32)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + lanes
        mask = offs < vocab_size
        x = tl.load(row_logits + offs, mask=mask, other=float("-inf")).to(tl.float32) * inverse_temperature
        x = tl.where(mask & (x >= threshold), x, float("-inf"))
        salted = offs.to(tl.uint32) * tl.full([], 0x85EBCA6B, tl.uint32)
        bits = hash32(row_hash ^ hash32(salted))
        uniform = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        noisy = x - tl.log(-tl.log(uniform))
        better = noisy > best
        best = tl.where(better, noisy, best)
        best_index = tl.where(better, offs, best_index)
        new_max = tl.maximum(lane_max, x)
        kept = x > float("-inf")
        seen = lane_max > float("-inf")
        lane_sum = tl.where(seen, lane_sum * tl.exp(lane_max - new_max), 0.0) + tl.where(
            kept, tl.exp(x - new_max), 0.0
        )
        lane_max = new_max
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_index, 2147483647), axis=0)
    row_max = tl.max(lane_max, axis=0)
    total = tl.sum(tl.where(lane_max > float("-inf"), lane_sum * tl.exp(lane_max - row_max), 0.0), axis=0)
    logit = tl.load(row_logits + token).to(tl.float32) * inverse_temperature
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, logit - row_max - tl.log(total))


def gumbel_rows(
    logits: torch.Tensor, keys: torch.Tensor, inverse_temperature: float, thresholds: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draws.gumbel_draw` for CUDA logits (rows, vocab) with a unit last stride."""
    rows, vocab_size = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _gumbel_kernel[(rows,)](
            logits, logits.stride(0), keys, thresholds if thresholds is not None else logprobs,
            tokens, logprobs, vocab_size, inverse_temperature,
            HAS_THRESHOLD=thresholds is not None, BLOCK=BLOCK, num_warps=8,
        )  # fmt: skip
    return tokens, logprobs
