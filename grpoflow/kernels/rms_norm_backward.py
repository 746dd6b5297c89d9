"""The gradients of transformers' RMSNorm, `weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)`
with float32 statistics, in one Triton kernel on CUDA.

With h = x in float32, r = rsqrt(mean(h**2) + eps), n = h * r and the output's gradient g:
d weight = sum over rows of g * n (n rounded to x's dtype, as the forward multiplies it), and
d x = r * (g * weight - n * mean(g * weight * n)). Each program takes a run of consecutive rows,
writing their d x and one row of partial weight gradients, which are summed in torch. Elsewhere
torch's autograd differentiates `ops.rms_norm_reference`. The batch-invariant RMSNorm's backward
(gradients need not be invariant); in place of the dozen elementwise kernels autograd runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpoflow.kernels.ops import rms_norm_reference


@triton.jit
def _rms_norm_backward_kernel(
    x_ptr, weight_ptr, grad_ptr, grad_x_ptr, partial_ptr, num_rows, num_cols, eps,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    dtype = x_ptr.dtype.element_ty
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    weight_grad = tl.zeros([BLOCK], tl.float32)
    for step in range(0, ROWS):
        row = program * ROWS + step
        inside = cols < tl.where(row < num_rows, num_cols, 0)  # a row past the last: none
        h = tl.load(x_ptr + row * num_cols + cols, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + row * num_cols + cols, mask=inside, other=0.0).to(tl.float32)
        inverse = tl.rsqrt(tl.sum(h * h, axis=0) / num_cols + eps)
        normed = h * inverse
        weight_grad += g * normed.to(dtype).to(tl.float32)
        scaled = g * weight
        grad_x = inverse * (scaled - normed * (tl.sum(scaled * normed, axis=0) / num_cols))
        tl.store(grad_x_ptr + row * num_cols + cols, grad_x.to(grad_x_ptr.dtype.element_ty), mask=inside)
    tl.store(partial_ptr + program * num_cols + cols, weight_grad, mask=mask)


def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d x, d weight) of `rms_norm_reference(x, weight, eps)` for the output gradient `grad`."""
    if not x.is_cuda:
        with torch.enable_grad():
            x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
            out = rms_norm_reference(x, weight, eps)
            return torch.autograd.grad(out, (x, weight), grad)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    grads = grad.reshape(rows.shape).contiguous()
    num_rows, num_cols = rows.shape
    grad_x = torch.empty_like(rows)
    wanted = max(1, min(num_rows, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count))
    rows_per_program = triton.next_power_of_2(triton.cdiv(num_rows, wanted))  # a few compiled variants
    programs = triton.cdiv(num_rows, rows_per_program) if num_rows else 1
    partial = torch.zeros((programs, num_cols), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(num_cols)
    _rms_norm_backward_kernel[(programs,)](
        rows, weight, grads, grad_x, partial, num_rows, num_cols, eps,
        ROWS=rows_per_program, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return grad_x.view(x.shape), partial.sum(0).to(weight.dtype)
