"""Batch-invariant matmul, RMSNorm and log-softmax: each row of a result is bit-identical whatever
the other rows are and however many there are.

cuBLAS picks its tiles, split-K and reduction order by the problem's shape, so a token's logits
depend on how many other tokens share its forward. Here every element sums its products over
the input in blocks of 64, in order, with no split-K, whatever the number of rows (the tile is
chosen by the product's shape, `tile_for`: tiles of one K step compute the same bits), and
RMSNorm and log-softmax reduce one row per program in a fixed order. A decode step of
one token per sequence and a training forward over whole sequences then compute the same row from
the same inputs bit for bit. Backward passes use ordinary torch ops: gradients need not be
invariant. `batch_invariant_attention` gives attention the same property.

Nor need a checkpointed layer's recompute, whose outputs feed only the backward: within
`recompute.recomputing()` (gradient checkpointing's recompute) the same autograd functions run
(they save the same tensors, as checkpointing requires) but compute with torch's own products
(cuBLAS), and the attention with torch's flash attention.

CUDA compiles these kernels; Triton's interpreter (`TRITON_INTERPRET=1`) runs them on the CPU.
Without it, CPU tensors go through `batch_invariant_cpu` (a torch call per row, also invariant).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from grpoflow.kernels import batch_invariant_cpu as cpu
from grpoflow.kernels.recompute import is_recomputing
from grpoflow.kernels.rms_norm_backward import rms_norm_backward


@dataclass(frozen=True)
class MatmulTile:
    """A tile configuration of `matmul`'s kernel."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8  # row tiles sharing columns in launch order (cache reuse; no effect on values)
    num_warps: int = 8
    num_stages: int = 3


MATMUL_TILE = MatmulTile()
"""The tile of products with fewer than LARGE_ROWS rows (a decode step's)."""
LARGE_TILE = MatmulTile(block_m=256)
"""The tile of products with LARGE_ROWS rows or more (a training forward's). Tiles that step
through the sum in blocks of 64 compute every element bit for bit alike (each element's products
accumulate in the same order into the same float32 accumulator, whatever the tile's extent over
rows and columns; on an H200 nine such tiles gave identical outputs at every shape tried,
`benchmarks/batch_invariant_tiles.py`), so choosing the tile by the row count keeps each row the
same; the larger one is ~8% faster at the trainer's shapes."""
LARGE_ROWS = 4096
SMALL_TILE = MatmulTile(block_m=64, block_n=64, num_warps=4, num_stages=4)
"""The tile of products too small to give MATMUL_TILE's tiles one per multiprocessor (a decode
step's narrow q/k/v, o and down products: 28 to 36 tiles of 128 x 128 at 512 rows); the same bits
as the other tiles, four times the programs."""
FEW_TILES = 128
"""Fewer MATMUL_TILE tiles than this (about an H100's or H200's multiprocessors) take SMALL_TILE."""
LOG_SOFTMAX_BLOCK = 1024
"""Lanes of a log-softmax row program: each lane folds every LOG_SOFTMAX_BLOCK-th logit."""


@triton.jit
def dot_tile(
    x_ptr, w_ptr, rows, cols, row_end, num_cols, depth, stride_xm, stride_xk, stride_wn, stride_wk,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # The tile's sums x[i, k] w[j, k] over k for its rows (those below row_end) and columns,
    # accumulated in float32 over BLOCK_K steps from k = 0: every kernel's products run this loop.
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for first in range(0, depth, BLOCK_K):
        k = first + ks
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=(rows < row_end)[:, None] & (k < depth)[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :] * stride_wn + k[:, None] * stride_wk,
            mask=(cols < num_cols)[None, :] & (k < depth)[:, None],
            other=0.0,
        )
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    return acc


@triton.jit(do_not_specialize=["num_rows"])
def _matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, num_rows, num_cols, depth,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # out[i, j] = sum_k x[i, k] w[j, k], accumulated in float32 over BLOCK_K steps from k = 0.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(num_rows, BLOCK_M)
    tiles_n = tl.cdiv(num_cols, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_size
    tile_n = (pid % per_group) // group_size
    rows = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = dot_tile(
        x_ptr, w_ptr, rows, cols, num_rows, num_cols, depth, stride_xm, stride_xk, stride_wn, stride_wk,
        IEEE, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < num_cols, other=0.0).to(tl.float32)[None, :]
    out_mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=out_mask)


def tile_for(num_rows: int, num_cols: int) -> MatmulTile:
    """`matmul`'s tile for a product of this many rows and output columns."""
    if num_rows >= LARGE_ROWS:
        return LARGE_TILE
    tiles = triton.cdiv(num_rows, MATMUL_TILE.block_m) * triton.cdiv(num_cols, MATMUL_TILE.block_n)
    return SMALL_TILE if tiles < FEW_TILES else MATMUL_TILE


def matmul_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tile: MatmulTile | None = None
) -> torch.Tensor:
    """x (..., K) @ weight (N, K).T (+ bias (N,)) -> (..., N) in x's dtype, float32 accumulation;
    no autograd (see `matmul`). `tile`: by the row count unless given (benchmarks compare them)."""
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"matmul needs one dtype for x ({x.dtype}), weight ({weight.dtype}) and bias "
            f"({None if bias is None else bias.dtype}); cast them to the model's dtype"
        )
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"matmul multiplies x (..., K) by weight (N, K); got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if not cpu.triton_runs(x):
        return cpu.matmul_rows(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    num_rows, depth = rows.shape
    num_cols = weight.shape[0]
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    tile = tile or tile_for(num_rows, num_cols)
    grid = (triton.cdiv(num_rows, tile.block_m) * triton.cdiv(num_cols, tile.block_n),)
    if num_rows > 0:
        _matmul_kernel[grid](
            rows, weight, bias if bias is not None else weight, out, num_rows, num_cols, depth,
            rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )  # fmt: skip
    return out.view(*x.shape[:-1], num_cols)


class _Matmul(torch.autograd.Function):
    """The batch-invariant forward; the backward in cuBLAS."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        if is_recomputing():
            return F.linear(x, weight, bias)
        return matmul_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        flat = grad.reshape(-1, grad.shape[-1])
        grad_weight = flat.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_bias = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` whose every row is bit-identical for any number of rows."""
    return _Matmul.apply(x, weight, bias)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, num_cols, stride_x, stride_residual, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # transformers' RMSNorm step by step: float32 upcast, mean of squares, rsqrt, cast back to the
    # input dtype, times the weight (in the promoted dtype). With a residual, x + residual first,
    # rounded to the dtype as eager's add rounds it (and stored: the next residual).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        summed = (residual.to(tl.float32) + x).to(dtype)
        tl.store(sum_ptr + row * num_cols + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    inverse = tl.rsqrt(tl.sum(x * x, axis=0) / num_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = weight * (x * inverse).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * num_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check_norm_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm needs a weight of shape ({x.shape[-1]},), got {tuple(weight.shape)}")


def _norm_rows(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows = _rows(x)
    residual_rows = _rows(residual) if residual is not None else rows
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty_like(rows) if residual is not None else None
    block = triton.next_power_of_2(rows.shape[1])
    if rows.shape[0] > 0:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, residual_rows, weight, out, summed if summed is not None else out, rows.shape[1],
            rows.stride(0), residual_rows.stride(0), eps, HAS_RESIDUAL=residual is not None,
            BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return out.view(x.shape), None if summed is None else summed.view(x.shape)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2RMSNorm / LlamaRMSNorm over the last dim, one program per row; no autograd."""
    _check_norm_weight(x, weight)
    if not cpu.triton_runs(x):
        return cpu.rms_norm_rows(x, weight, eps)
    return _norm_rows(x, weight, eps, None)[0]


def add_rms_norm_forward(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_forward(residual + x)` and `residual + x` (eager's rounding) in one kernel."""
    if not cpu.triton_runs(x):
        summed = residual + x
        return rms_norm_forward(summed, weight, eps), summed
    _check_norm_weight(x, weight)
    out, summed = _norm_rows(x, weight, eps, residual)
    return out, summed


class _RmsNorm(torch.autograd.Function):
    """The batch-invariant forward (one kernel, a checkpoint's recompute too); the backward
    `rms_norm_backward`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_forward(x, weight, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x, grad_weight = rms_norm_backward(x, weight, grad, ctx.eps)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (`weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`)
    whose every row is bit-identical for any number of rows."""
    return _RmsNorm.apply(x, weight, eps)


@triton.jit
def _log_softmax_kernel(logits_ptr, out_ptr, num_cols, stride_row, BLOCK: tl.constexpr):
    # Pass 1: every lane keeps a running max and a sum of exponentials below it (one exp per logit);
    # the lanes then reduce in a fixed tree. Pass 2 writes logit - max - log(sum).
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], -1e30, tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    for first in range(0, num_cols, BLOCK):
        offs = first + lanes
        x = tl.load(logits_ptr + row * stride_row + offs, mask=offs < num_cols, other=float("-inf"))
        x = x.to(tl.float32)
        delta = x - lane_max
        rises = delta > 0
        shrink = tl.exp(-tl.abs(delta))
        lane_sum = tl.where(rises, lane_sum * shrink + 1.0, lane_sum + shrink)
        lane_max = tl.maximum(lane_max, x)
    row_max = tl.max(lane_max, axis=0)
    log_total = tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0))
    for first in range(0, num_cols, BLOCK):
        offs = first + lanes
        mask = offs < num_cols
        x = tl.load(logits_ptr + row * stride_row + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * num_cols + offs, x - row_max - log_total, mask=mask)


def log_softmax_forward(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax over the last dim, one program per row; no autograd."""
    if not cpu.triton_runs(logits):
        return cpu.log_softmax_rows(logits)
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=logits.device)
    if rows.shape[0] > 0:
        _log_softmax_kernel[(rows.shape[0],)](
            rows, out, rows.shape[1], rows.stride(0), BLOCK=LOG_SOFTMAX_BLOCK, num_warps=4
        )
    return out.view(logits.shape)


class _LogSoftmax(torch.autograd.Function):
    """The batch-invariant forward; the backward from the saved result in torch."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        out = log_softmax_forward(logits)
        ctx.save_for_backward(out)
        ctx.input_dtype = logits.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        return (grad - out.exp() * grad.sum(-1, keepdim=True)).to(ctx.input_dtype)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.float().log_softmax(-1)` whose every row is bit-identical for any number of rows."""
    return _LogSoftmax.apply(logits)
