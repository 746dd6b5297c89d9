"""SwiGLU's `silu(gate) * up` for the batch-invariant forwards: the native engine's (a decode step,
a prefill) and the training forward's compute it with one Triton kernel (`decoder`'s, the engine's
fused path), elementwise and so the same bits for a token whatever shares the call, where eager
runs a SiLU and a product; the backward is one Triton kernel too (gradients need not be invariant).
Where Triton does not run (the CPU), eager's `F.silu(gate) * up` on both sides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from grpoflow.kernels import batch_invariant_cpu as cpu

BLOCK = 1024


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate and up (..., I) -> silu(gate) * up, no autograd; the last dim contiguous."""
    if not cpu.triton_runs(gate):
        return F.silu(gate) * up
    from grpoflow.kernels.decoder import TritonOps

    width = gate.shape[-1]
    gate2, up2 = (
        x.reshape(-1, width) if x.stride(-1) == 1 else x.contiguous().view(-1, width) for x in (gate, up)
    )
    return TritonOps.silu_mul(gate2, up2).view(gate.shape)


@triton.jit
def _silu_mul_backward_kernel(
    gate_ptr, up_ptr, grad_ptr, grad_gate_ptr, grad_up_ptr, count, BLOCK: tl.constexpr
):  # fmt: skip
    # Contiguous tensors, BLOCK elements a program.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < count
    dtype = gate_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    sigmoid = 1.0 / (1.0 + tl.exp(-gate))
    activated = (gate * sigmoid).to(dtype).to(tl.float32)
    tl.store(grad_up_ptr + offsets, (grad * activated).to(dtype), mask=inside)
    slope = sigmoid * (1.0 + gate * (1.0 - sigmoid))
    tl.store(grad_gate_ptr + offsets, (grad * up * slope).to(dtype), mask=inside)


def silu_mul_backward(
    gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of `silu(gate) * up` for the output gradient `grad`."""
    if not gate.is_cuda:
        with torch.enable_grad():
            leaves = [gate.detach().requires_grad_(), up.detach().requires_grad_()]
            return torch.autograd.grad(F.silu(leaves[0]) * leaves[1], leaves, grad)
    gate, up, grad = (x.contiguous() for x in (gate, up, grad))
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
    if gate.numel():
        _silu_mul_backward_kernel[(triton.cdiv(gate.numel(), BLOCK),)](
            gate, up, grad, grad_gate, grad_up, gate.numel(), BLOCK=BLOCK, num_warps=4
        )
    return grad_gate, grad_up


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return silu_mul_forward(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        return silu_mul_backward(gate, up, grad)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu_mul_forward` with autograd (gradients for gate and up)."""
    return _SiluMul.apply(gate, up)
