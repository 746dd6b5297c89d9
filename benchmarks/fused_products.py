"""Decode-step products with their elementwise neighbours folded in, as Triton kernels: what
`decode_products.py` times against the native engine's separate kernels.

A decode step of a small model is a chain of small kernels: at 512 rows of the Qwen2-0.5B shape,
each RMSNorm and each SiLU-and-multiply is a launch of its own that writes a tensor only for the
next product to read it back. `norm_product` adds the residual, takes the row's RMS and applies
the norm's weight while it loads the product's input tiles (the row's scale, known only once its
last tile is in, multiplies the accumulator instead); `norm_gated_product` does the same over
gate/up's weights with two accumulators and forms `silu(gate) * up` as it stores; `gated_product`
forms `silu(gate) * up` while loading down's input; `plain_product` is the bare product. Rounding
follows the reference ops where it can, so results agree with the separate kernels to within the
model dtype's rounding, not bit for bit.

On an H200 with Triton 3.6 each of them is slower than the separate kernels it would replace
(benchmarks/results/2026-11-28-decode-products-*): the bare product already trails cuBLAS by
20-55% on the decode shapes, and an input tile that passes through registers on its way to the
product is not pipelined by Triton. The engine keeps its separate kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

NORM, GATED, PLAIN = 1, 2, 0


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    prefetch: bool = True


@triton.jit
def _product_kernel(
    x_ptr, up_ptr, residual_ptr, residual_out_ptr, norm_ptr, w_ptr, bias_ptr, out_ptr,
    rows, cols, depth, stride_x, stride_up, stride_residual, stride_w, stride_out, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    IEEE: tl.constexpr, PREFETCH: tl.constexpr, DUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Programs run a column tile's row tiles back to back, so that the weight tile, the larger
    # operand at decode, comes from memory once and from L2 for the other row tiles.
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(rows, BLOCK_M)
    pid_m = pid % row_tiles
    pid_n = pid // row_tiles
    dtype = w_ptr.dtype.element_ty
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_ok = m < rows
    n_ok = n < cols
    m64 = m.to(tl.int64)
    x_rows = x_ptr + m64[:, None] * stride_x
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    squares = tl.zeros((BLOCK_M,), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # The input tiles pass through registers on their way to the product, which Triton's pipeliner
    # does not prefetch: each is loaded one iteration ahead by hand.
    a_next = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < depth)[None, :], other=0.0)
    for first in range(0, depth, BLOCK_K):
        ks = first + k
        if EVEN_K:
            a_mask = m_ok[:, None]
            w_mask = n_ok[:, None]
        else:
            a_mask = m_ok[:, None] & (ks < depth)[None, :]
            w_mask = n_ok[:, None] & (ks < depth)[None, :]
        a = a_next
        if PREFETCH:
            ahead = ks + BLOCK_K
            a_next = tl.load(
                x_rows + ahead[None, :], mask=m_ok[:, None] & (ahead < depth)[None, :], other=0.0
            )
        else:
            a = tl.load(x_rows + ks[None, :], mask=a_mask, other=0.0)
        if PROLOGUE == 1:  # residual add and RMSNorm's weight; the row's scale comes after
            if HAS_RESIDUAL:
                summed = tl.load(
                    residual_ptr + m64[:, None] * stride_residual + ks[None, :], mask=a_mask, other=0.0
                )
                a = (a.to(tl.float32) + summed.to(tl.float32)).to(dtype)
                if pid_n == 0:
                    tl.store(residual_out_ptr + m64[:, None] * depth + ks[None, :], a, mask=a_mask)
            af = a.to(tl.float32)
            squares += tl.sum(af * af, axis=1)
            weight = tl.load(norm_ptr + ks, mask=ks < depth, other=0.0).to(tl.float32)
            a = (af * weight[None, :]).to(dtype)
        elif PROLOGUE == 2:  # silu(gate) * up, each rounded to the dtype as the reference does
            gate = a.to(tl.float32)
            up = tl.load(up_ptr + m64[:, None] * stride_up + ks[None, :], mask=a_mask, other=0.0)
            activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            a = (activated * up.to(tl.float32)).to(dtype)
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        if DUAL:  # the up half's rows, `cols` below the gate's, into a second accumulator
            w2 = tl.load(w_rows + cols * stride_w + ks[None, :], mask=w_mask, other=0.0)
            if IEEE:
                acc2 = tl.dot(a, tl.trans(w2), acc2, input_precision="ieee")
            else:
                acc2 = tl.dot(a, tl.trans(w2), acc2)
    if PROLOGUE == 1:
        acc = acc * tl.rsqrt(squares / depth + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if DUAL:  # silu(gate) * up from the two accumulators, each rounded as the reference does
        if PROLOGUE == 1:
            acc2 = acc2 * tl.rsqrt(squares / depth + eps)[:, None]
        gate = acc.to(dtype).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = activated * acc2.to(dtype).to(tl.float32)
    out = out_ptr + m64[:, None] * stride_out + n[None, :]
    tl.store(out, acc.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


def product_config(rows: int, cols: int, depth: int) -> Tiles:
    """Default tiles for a (rows x depth) @ (depth x cols) decode product (the sweep tries others)."""
    block_m = 64 if rows > 32 else max(16, triton.next_power_of_2(rows))
    block_n = 128 if cols >= 4096 else 64
    return Tiles(block_m, block_n, 64, 4, 4)


def _launch(
    prologue: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    up: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    tiles: Tiles | None = None,
    dual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, depth = x.shape
    cols = weight.shape[0] // 2 if dual else weight.shape[0]
    assert x.stride(1) == 1 and weight.stride(1) == 1, "the products need unit column strides"
    tiles = tiles or product_config(rows, cols, depth)
    out = torch.empty((rows, cols), dtype=weight.dtype, device=x.device)
    residual_out = torch.empty((rows, depth), dtype=x.dtype, device=x.device) if residual is not None else x
    grid = (triton.cdiv(rows, tiles.block_m) * triton.cdiv(cols, tiles.block_n),)
    _product_kernel[grid](
        x, up if up is not None else x, residual if residual is not None else x, residual_out,
        norm if norm is not None else weight, weight, bias if bias is not None else weight, out,
        rows, cols, depth, x.stride(0), up.stride(0) if up is not None else 0,
        residual.stride(0) if residual is not None else 0, weight.stride(0), out.stride(0), eps,
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        EVEN_K=depth % tiles.block_k == 0, IEEE=x.dtype == torch.float32, PREFETCH=tiles.prefetch, DUAL=dual,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out, residual_out


def norm_product(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`F.linear(rms_norm(x + residual), weight, bias)` and `x + residual` (x itself without a
    residual), as `TorchOps.rms_norm` then `F.linear` give them: x, residual (T, H) with unit
    column stride; weight (N, H)."""
    return _launch(NORM, x, weight, bias, residual=residual, norm=norm_weight, eps=eps, tiles=tiles)


def gated_product(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """`F.linear(silu(gate) * up, weight, bias)`: gate and up (T, I) may be row-strided views (the
    halves of one fused product); weight (N, I)."""
    assert gate.stride(1) == 1 and up.stride(1) == 1, "gated_product needs unit column strides"
    return _launch(GATED, gate, weight, bias, up=up, tiles=tiles)[0]


def plain_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: Tiles | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by the same kernel (for timing it against cuBLAS)."""
    return _launch(PLAIN, x, weight, bias, tiles=tiles)[0]


def norm_gated_product(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    gate_up_weight: torch.Tensor,
    tiles: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu(gate) * up` where gate, up = `F.linear(rms_norm(x + residual), gate_up_weight)`'s
    halves, and `x + residual`: gate_up_weight (2I, H), the gate's rows then the up's."""
    return _launch(
        NORM, x, gate_up_weight, None, residual=residual, norm=norm_weight, eps=eps, tiles=tiles, dual=True
    )
