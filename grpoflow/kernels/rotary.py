"""transformers' rotate-half rotary embedding, `q * cos + rotate_half(q) * sin` for the query and
the key, with the backward and a checkpointed layer's recompute one Triton kernel each.

The forward is eager's formula, whose bits the native engine's rotary reproduces; the recompute
(`recompute.recomputing()`, whose outputs only feed the backward) and the backward, the same
rotation by -sin (the rotation's transpose), run `_rotary_kernel` (each product, then the sum,
rounded to the input's dtype, as `decoder._rotate_halves` does; gradients need not match any other
computation's bits). Autograd keeps only cos and sin, where eager's formula keeps its products'
inputs and runs a dozen elementwise kernels each way. Eager's formula is `ops.rotate`, which the
kernel's part also runs where Triton does not (the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpoflow.kernels import batch_invariant_cpu as cpu
from grpoflow.kernels import ops
from grpoflow.kernels.decoder import _rotate_halves
from grpoflow.kernels.recompute import is_recomputing


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, length, num_heads,
    stride_xb, stride_xh, stride_xl, stride_cb, stride_cl, stride_ob, stride_oh, stride_ol, sign,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
):  # fmt: skip
    # One program per (sequence, position): every head of it, halves as two tiles.
    token = tl.program_id(0).to(tl.int64)
    batch, position = token // length, token % length
    dtype = x_ptr.dtype.element_ty
    d = tl.arange(0, HALF_PAD)[None, :]
    head = tl.arange(0, HEADS_PAD)[:, None]
    mask = (d < HALF) & (head < num_heads)
    table = batch * stride_cb + position * stride_cl + d
    cos = tl.load(cos_ptr + table, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + table, mask=d < HALF, other=0.0).to(tl.float32) * sign
    base = x_ptr + batch * stride_xb + position * stride_xl + head * stride_xh + d
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    out1, out2 = _rotate_halves(x1, x2, cos, sin, dtype)
    out = out_ptr + batch * stride_ob + position * stride_ol + head * stride_oh + d
    tl.store(out, out1, mask=mask)
    tl.store(out + HALF, out2, mask=mask)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """x (B, H, L, D) rotated by cos and sin (B, L, D) (times `sign`), no autograd; the result laid
    out (B, L, H, D) in memory, as eager's from a projection's view."""
    batch, num_heads, length, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not cpu.triton_runs(x):
        return ops.rotate(x, cos, sin * sign)
    cos, sin = cos.expand(batch, length, head_dim), sin.expand(batch, length, head_dim)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((batch, length, num_heads, head_dim), dtype=x.dtype, device=x.device).transpose(1, 2)
    if out.numel():
        _rotary_kernel[(batch * length,)](
            x, cos, sin, out, length, num_heads,
            x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1),
            out.stride(0), out.stride(1), out.stride(2), sign,
            HALF=head_dim // 2, HALF_PAD=triton.next_power_of_2(head_dim // 2),
            HEADS_PAD=triton.next_power_of_2(num_heads), num_warps=2,
        )  # fmt: skip
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        ctx.save_for_backward(cos, sin)
        apply = rotate if is_recomputing() else ops.rotate
        return apply(q, cos, sin), apply(k, cos, sin)

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):
        cos, sin = ctx.saved_tensors
        grads = [None if g is None else rotate(g, cos, sin, -1.0) for g in (grad_q, grad_k)]
        return grads[0], grads[1], None, None


def rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb` for q (B, Hq, L, D), k (B, Hkv, L, D) and cos, sin
    (B or 1, L, D) (`unsqueeze_dim` 1; another falls back to eager's formula)."""
    if unsqueeze_dim != 1 or cos.dim() != 3 or q.shape[-1] % 2:
        return ops.rotate(q, cos, sin, unsqueeze_dim), ops.rotate(k, cos, sin, unsqueeze_dim)
    return _Rotary.apply(q, k, cos, sin)
