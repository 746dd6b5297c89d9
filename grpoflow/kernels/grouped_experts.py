"""A mixture-of-experts layer's SwiGLU experts for the training forward and backward, as two
grouped products with nothing else between them but one gather and one fused kernel each way.

`experts(x, gate_up, down, chosen, weights)` takes the tokens x (T, H), the fused expert weights in
transformers' layout (`gate_up` (E, 2I, H), gate rows first, and `down` (E, H, I)), and each
token's k chosen experts with their routing weights (T, k). Forward:

1. the (token, slot) pairs are sorted by expert (`expert_order`) and the tokens gathered in that
   order (S = T k rows);
2. the gate and up projections of every row run as one grouped product (`torch._grouped_mm`),
   `silu(gate) * up` as one kernel, the down projection as a second grouped product;
3. one kernel sums each token's k output rows times their weights, in float32, rounded once.

The backward runs the same steps in reverse: the tokens' gradients gathered in the sorted order,
the down projection's grouped product transposed, then one kernel for SwiGLU's backward that also
applies the routing weights and takes their gradients (each the dot of the unweighted gradient
with the expert's SwiGLU output: the same as with its output row, without keeping that row), the
gate and up projections' grouped product transposed, and the gather's backward as the weighted-sum
kernel with unit weights. The experts' weight gradients are grouped products too, computed only
when the weights train (full training, or LoRA on the experts through PEFT's `target_parameters`,
which hands the experts W + B A). The forward keeps only the gate and up projections (S, 2I) and
the sort's indices for the backward: no masks, no copies of the sorted rows or outputs.

transformers' own `grouped_mm` path (5.x) spends about as long as its grouped products in masked
fills, index puts, multiplies and copies around them on an H200; this one does not.

`register(name)` makes it one of transformers' experts implementations (`policy.loading` names it
grpoflow_grouped, the default for a MoE policy on CUDA whose experts have the plain layout:
`experts_refusal`). On the CPU (the reference, and
where Triton does not run) the grouped products loop over the experts and the kernels are torch
expressions of the same arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from grpoflow.kernels.batch_invariant_cpu import triton_runs
from grpoflow.kernels.ops import expert_order, grouped_product, grouped_weight_grad

BLOCK = 1024


@triton.jit
def _weighted_sum_kernel(
    rows_ptr, slots_ptr, weights_ptr, out_ptr, width, TOP_K: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # Program (token, column block): the sum over the token's TOP_K slots of its sorted row times
    # the slot's weight (one when not WEIGHTED), in float32.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        row = tl.load(slots_ptr + token * TOP_K + slot).to(tl.int64)
        values = tl.load(rows_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
        if WEIGHTED:
            values = values * tl.load(weights_ptr + token * TOP_K + slot).to(tl.float32)
        acc += values
    tl.store(out_ptr + token * width + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


def weighted_sum(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] rows[slots[t, j]] (weights of one when None): rows (S, H),
    slots and weights (T, k) -> (T, H) in rows' dtype, summed in float32."""
    num_tokens, top_k = slots.shape
    width = rows.shape[1]
    if not triton_runs(rows):
        wide = torch.promote_types(rows.dtype, torch.float32)
        picked = rows[slots].to(wide)
        if weights is not None:
            picked = picked * weights[..., None].to(wide)
        return picked.sum(dim=1).to(rows.dtype)
    rows, slots = rows.contiguous(), slots.contiguous()
    out = rows.new_empty((num_tokens, width))
    if num_tokens:
        scale = weights.contiguous() if weights is not None else slots
        _weighted_sum_kernel[(num_tokens, triton.cdiv(width, BLOCK))](
            rows, slots, scale, out, width, TOP_K=top_k, WEIGHTED=weights is not None, BLOCK=BLOCK,
            num_warps=4,
        )  # fmt: skip
    return out


@triton.jit
def _swiglu_kernel(fused_ptr, out_ptr, width, BLOCK: tl.constexpr):
    # Program (row, column block) of fused (S, 2 width), gate columns first: silu(gate) * up.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    dtype = fused_ptr.dtype.element_ty
    gate = tl.load(fused_ptr + row * 2 * width + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(fused_ptr + row * 2 * width + width + cols, mask=inside, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (activated * up).to(dtype), mask=inside)


@triton.jit
def _swiglu_backward_kernel(
    fused_ptr, grad_ptr, weights_ptr, grad_fused_ptr, dots_ptr, width, DOTS: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    # Program per row: d gate and d up of weight * silu(gate) * up for the output gradient grad
    # (of the unweighted product) into the fused layout; with DOTS, <grad, silu(gate) * up>, the
    # weight's gradient.
    row = tl.program_id(0).to(tl.int64)
    dtype = fused_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + row).to(tl.float32)
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < width
        gate = tl.load(fused_ptr + row * 2 * width + cols, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(fused_ptr + row * 2 * width + width + cols, mask=inside, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
        sigmoid = 1.0 / (1.0 + tl.exp(-gate))
        activated = (gate * sigmoid).to(dtype).to(tl.float32)
        if DOTS:
            dot += grad * (activated * up).to(dtype).to(tl.float32)
        grad = grad * weight
        slope = sigmoid * (1.0 + gate * (1.0 - sigmoid))
        tl.store(grad_fused_ptr + row * 2 * width + cols, (grad * up * slope).to(dtype), mask=inside)
        tl.store(grad_fused_ptr + row * 2 * width + width + cols, (grad * activated).to(dtype), mask=inside)
    if DOTS:
        tl.store(dots_ptr + row, tl.sum(dot, axis=0))


def swiglu(fused: torch.Tensor) -> torch.Tensor:
    """fused (S, 2I), gate columns first -> silu(gate) * up (S, I), SiLU rounded to the dtype first
    as eager's two ops round it."""
    width = fused.shape[1] // 2
    if not triton_runs(fused):
        gate, up = fused.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    fused = fused.contiguous()
    out = fused.new_empty((fused.shape[0], width))
    if fused.shape[0]:
        _swiglu_kernel[(fused.shape[0], triton.cdiv(width, BLOCK))](
            fused, out, width, BLOCK=BLOCK, num_warps=4
        )
    return out


def swiglu_backward(
    fused: torch.Tensor, grad: torch.Tensor, weights: torch.Tensor, dots: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For rows weights (S,) times `swiglu(fused)` (S, I) and the gradient grad (S, I) of the
    unweighted product: the gradient (S, 2I) at `fused` and, with `dots`, the weights' gradients
    (S,) float32, each row's <grad, swiglu(fused)>."""
    width = grad.shape[1]
    if not triton_runs(fused):
        wide = torch.promote_types(fused.dtype, torch.float32)
        with torch.enable_grad():
            leaf = fused.detach().requires_grad_()
            activated = swiglu(leaf)
            (grad_fused,) = torch.autograd.grad(
                activated, leaf, (grad.to(wide) * weights[:, None].to(wide)).to(grad.dtype)
            )
        products = (grad.to(wide) * activated.detach().to(wide)).sum(dim=-1) if dots else None
        return grad_fused, products
    fused, grad, weights = fused.contiguous(), grad.contiguous(), weights.contiguous()
    grad_fused = torch.empty_like(fused)
    products = torch.empty(fused.shape[0], dtype=torch.float32, device=fused.device) if dots else None
    if fused.shape[0]:
        _swiglu_backward_kernel[(fused.shape[0],)](
            fused, grad, weights, grad_fused, products if dots else weights, width, DOTS=dots,
            BLOCK=min(4096, triton.next_power_of_2(width)), num_warps=4,
        )  # fmt: skip
    return grad_fused, products


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_up, down, chosen, weights):
        num_tokens, top_k = chosen.shape
        order, ends = expert_order(chosen, gate_up.shape[0])
        slots = torch.empty_like(order)
        slots[order] = torch.arange(order.shape[0], device=order.device)
        slots = slots.view(num_tokens, top_k)
        fused = grouped_product(x.index_select(0, order // top_k), gate_up.transpose(1, 2), ends)
        rows = grouped_product(swiglu(fused), down.transpose(1, 2), ends)
        ctx.save_for_backward(x, gate_up, down, weights, order, ends, slots, fused)
        return weighted_sum(rows, slots, weights)

    @staticmethod
    def backward(ctx, grad):
        x, gate_up, down, weights, order, ends, slots, fused = ctx.saved_tensors
        need_x, need_gate_up, need_down, _, need_weights = ctx.needs_input_grad
        num_experts, tokens = gate_up.shape[0], order // slots.shape[1]
        sorted_weights = weights.reshape(-1)[order]
        grad_rows = grad.index_select(0, tokens)
        grad_down = None
        if need_down:
            activated = swiglu(fused) * sorted_weights[:, None].to(fused.dtype)
            grad_down = grouped_weight_grad(grad_rows, activated, ends, num_experts)
            del activated
        grad_fused, products = swiglu_backward(
            fused, grouped_product(grad_rows, down, ends), sorted_weights, need_weights
        )
        del grad_rows
        grad_weights = None
        if need_weights:
            grad_weights = torch.empty_like(products)
            grad_weights[order] = products
            grad_weights = grad_weights.view_as(weights).to(weights.dtype)
        grad_gate_up = grad_x = None
        if need_gate_up:
            gathered = x.index_select(0, tokens)
            grad_gate_up = grouped_weight_grad(grad_fused, gathered, ends, num_experts)
            del gathered
        if need_x:
            grad_x = weighted_sum(grouped_product(grad_fused, gate_up, ends), slots, None)
        return grad_x, grad_gate_up, grad_down, None, grad_weights


def experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The SwiGLU experts' weighted sum (T, H) for the tokens x (T, H): gate_up (E, 2I, H), gate
    rows first, down (E, H, I), the chosen experts (T, k) and their weights (T, k). Differentiable
    in x, both weights and the routing weights."""
    return _Experts.apply(x, gate_up, down, chosen, weights)


def experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts interface: the module's `gate_up_proj` and `down_proj` (as PEFT's
    adapters on them make them, when they have some) by `experts`."""
    gate_up, down = self.gate_up_proj, self.down_proj
    out = experts(hidden_states.to(gate_up.dtype), gate_up, down, top_k_index, top_k_weights)
    return out.to(hidden_states.dtype)


def experts_refusal(model: nn.Module) -> str | None:
    """Why `experts_forward` cannot run `model`'s experts; None when every experts module has the
    plain layout (fused [gate; up] rows, untransposed, no bias) and a SiLU gate."""
    act = getattr(model.config, "hidden_act", None)
    if act not in ("silu", "swish"):
        return f"hidden_act={act!r} (the kernel's gate is SiLU)"
    for module in model.modules():
        if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")):
            continue
        flags = (
            getattr(module, "is_transposed", False),
            getattr(module, "is_concatenated", True),
            getattr(module, "has_bias", False),
            getattr(module, "has_gate", True),
        )
        if flags != (False, True, False, True):
            return "an expert layout other than concatenated [gate; up] rows, untransposed, without bias"
        apply_gate = getattr(type(module), "_apply_gate", None)
        if apply_gate is not None and apply_gate.__name__ != "_default_apply_gate":
            return f"{type(module).__name__} gates its experts its own way"
    return None


def register(name: str) -> None:
    """Make `experts_forward` transformers' `experts_implementation=name`."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(name, experts_forward)
