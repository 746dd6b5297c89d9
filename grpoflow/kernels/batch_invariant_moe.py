"""A mixture-of-experts layer on the batch-invariant kernels: the router and the experts of a
token computed bit for bit alike whatever other tokens share the forward, so that the native
engine's decode steps and the training forward route every token to the same experts and give it
the same output.

`grouped_matmul` multiplies rows sorted by expert by their expert's weight: each output row is
`batch_invariant.matmul_forward(row, weight[expert])` bit for bit, the same loop over the input in
blocks of 64 (`batch_invariant.dot_tile`), whatever the other rows and groups are. Its programs
run over (expert, row tile) pairs and column tiles, each finding its expert from per-expert tile
counts computed on the device, so nothing waits on the host (a decode step stays capturable in a
CUDA graph). `route` (the softmax, as the log-softmax kernel's rows exponentiated, top k and
renormalisation of transformers' Qwen3-MoE router) and `experts` (the SwiGLU experts and the
weighted sum of a token's k outputs in slot order) are the one computation both forwards call.
Backward passes are ordinary torch (grouped products by `torch._grouped_mm` where it runs, a loop
over the experts elsewhere).

On the CPU without Triton's interpreter the products go expert by expert through
`batch_invariant_cpu.matmul_rows`, and the log-softmax and SiLU one row at a time
(`batch_invariant_cpu`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from grpoflow.kernels import batch_invariant_cpu as cpu
from grpoflow.kernels.batch_invariant import (
    MATMUL_TILE,
    SMALL_TILE,
    MatmulTile,
    dot_tile,
    log_softmax,
)
from grpoflow.kernels.ops import expert_order, grouped_grads, grouped_mm_runs


@triton.jit
def _grouped_matmul_kernel(
    x_ptr, w_ptr, bounds_ptr, out_ptr, num_experts, num_cols, depth,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):  # fmt: skip
    # Program (p, n): the p-th (expert, row tile) pair in expert order, column tile n. bounds
    # (4, E): each expert's first row, end row, first tile and end tile.
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    tile_ends = tl.load(bounds_ptr + 3 * num_experts + experts, mask=experts < num_experts, other=2**30)
    expert = tl.sum((tile_ends <= pid).to(tl.int32), axis=0)
    if expert < num_experts:
        start = tl.load(bounds_ptr + expert)
        end = tl.load(bounds_ptr + num_experts + expert)
        tile = pid - tl.load(bounds_ptr + 2 * num_experts + expert)
        rows = (start + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        acc = dot_tile(
            x_ptr, w_ptr + expert.to(tl.int64) * stride_we, rows, cols, end, num_cols, depth,
            stride_xm, stride_xk, stride_wn, stride_wk, IEEE, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        out_mask = (rows < end)[:, None] & (cols < num_cols)[None, :]
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=out_mask)


def grouped_tile(num_rows: int, num_experts: int) -> MatmulTile:
    """The grouped product's tile: SMALL_TILE where an expert has fewer rows than MATMUL_TILE's
    on average (a decode step's), else MATMUL_TILE; tiles of one K step compute the same bits."""
    return SMALL_TILE if num_rows < MATMUL_TILE.block_m * num_experts else MATMUL_TILE


def _check(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> None:
    if x.dtype != weight.dtype:
        raise ValueError(f"grouped_matmul needs one dtype for x ({x.dtype}) and weight ({weight.dtype})")
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"grouped_matmul multiplies rows x (M, K) by weight (E, N, K); got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if ends.shape != (weight.shape[0],) or ends.dtype != torch.int32:
        raise ValueError(
            f"grouped_matmul needs ends (E,) int32 (each expert's end row); got {tuple(ends.shape)} {ends.dtype}"
        )


def grouped_matmul_forward(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows x (M, K) sorted by expert, expert e's rows ending at `ends[e]` (the last end M), times
    their expert's weight (E, N, K) transposed -> (M, N) in x's dtype; each row bit for bit
    `matmul_forward(row, weight[e])`. No autograd (see `grouped_matmul`)."""
    _check(x, weight, ends)
    if not cpu.triton_runs(x):
        return cpu.grouped_matmul_rows(x, weight, ends)
    num_rows, depth = x.shape
    num_experts, num_cols = weight.shape[:2]
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    tile = grouped_tile(num_rows, num_experts)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + tile.block_m - 1) // tile.block_m
    tile_ends = torch.cumsum(tiles, 0, dtype=torch.int32)
    tile_starts = tile_ends - tiles
    bounds = torch.stack([starts, ends, tile_starts, tile_ends]).contiguous()
    grid = (triton.cdiv(num_rows, tile.block_m) + num_experts, triton.cdiv(num_cols, tile.block_n))
    _grouped_matmul_kernel[grid](
        x, weight, bounds, out, num_experts, num_cols, depth,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0),
        IEEE=x.dtype == torch.float32, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return out


class _GroupedMatmul(torch.autograd.Function):
    """The batch-invariant forward; the backward in torch (`ops.grouped_grads`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, ends)
        return grouped_matmul_forward(x, weight, ends)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, ends = ctx.saved_tensors
        grad_x, grad_weight = grouped_grads(
            grad.contiguous(), x, weight, ends, grouped_mm_runs(x.device, x.dtype)
        )
        return grad_x, grad_weight, None


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`grouped_matmul_forward` with autograd (gradients for x and weight)."""
    return _GroupedMatmul.apply(x, weight, ends)


def _slot_sum(parts: torch.Tensor) -> torch.Tensor:
    """parts (T, k, ...) summed over the k slots in slot order (one rounded add each)."""
    total = parts[:, 0]
    for slot in range(1, parts.shape[1]):
        total = total + parts[:, slot]
    return total


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> weights (T, k) in the logits' dtype and the chosen experts (T, k),
    best first, ties to the lower index: transformers' Qwen3-MoE routing (float32 softmax, top k,
    renormalised when `normalize`) with every row its own bits. Differentiable in the logits."""
    probs = log_softmax(logits).exp()
    chosen = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    top = probs.gather(-1, chosen)
    if normalize:
        top = top / _slot_sum(top)[:, None]
    return top.to(logits.dtype), chosen


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's `silu(gate) * up` rounded as transformers rounds it; a row at a time on the CPU
    (whose vectorised SiLU rounds the tail of a tensor apart from its body)."""
    if gate.is_cuda:
        return F.silu(gate) * up
    return cpu.silu_mul_rows(gate, up)


def experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The SwiGLU experts' weighted sum for each token x (T, H): gate_up (E, 2I, H) gate rows
    first, down (E, H, I), the chosen experts and their weights (T, k). The (token, expert) pairs
    sorted by expert run as two grouped products; a token's k outputs, each times its weight, are
    summed in float32 in slot order and rounded once. Differentiable (x, the weights and both
    parameters) while gradients are on."""
    num_tokens, top_k = chosen.shape
    product = grouped_matmul if torch.is_grad_enabled() else grouped_matmul_forward
    order, ends = expert_order(chosen, gate_up.shape[0])
    gate, up = product(x[order // top_k], gate_up, ends).chunk(2, dim=-1)
    out = product(silu_mul(gate, up), down, ends)
    by_token = out.index_select(0, torch.argsort(order)).view(num_tokens, top_k, -1)
    return _slot_sum((by_token * weights[..., None]).float()).to(x.dtype)
