"""LoRA's dropout inside the adapter's first product, keeping a one-byte mask instead of a copy.

PEFT computes an adapted layer's branch as `lora_B(lora_A(dropout(x)))`. The dropout's output is
a new tensor the size of the layer's input, which `lora_A` keeps for its weight's gradient, and
the dropout keeps its mask beside it: 3 bytes per input element in bfloat16 for every adapted
layer, although q, k and v read one input. For Qwen3-30B-A3B adapted on its attention, that is
31 KB per token and layer, more than its experts keep.

`fuse_lora_dropout(model)` makes each plain LoRA layer's dropout part of `lora_A`'s product
(`DroppedInputLinear`, the same parameter under the same name): the product keeps the input
itself (one tensor, however many layers read it) and a boolean mask, and recomputes the dropped
input in the backward pass. The distribution is PEFT's (each element kept with probability 1 - p
and scaled by 1 / (1 - p)); a checkpointed layer's recompute draws the same mask, since torch
restores the RNG state for it. In eval mode the product is a plain one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from grpoflow.policy.lora_precision import InputDtypeLinear


def _masked(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """x * keep * scale in one pass (the kernel of dropout's backward)."""
    return torch.ops.aten.native_dropout_backward(x, keep, scale)


class _DroppedProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, p: float) -> torch.Tensor:
        keep = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1 - p)
        ctx.scale = 1 / (1 - p)
        ctx.save_for_backward(x, weight, keep)
        return F.linear(_masked(x, keep, ctx.scale), weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, keep = ctx.saved_tensors
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = _masked(grad @ weight, keep, ctx.scale)
        if ctx.needs_input_grad[1]:
            dropped = _masked(x, keep, ctx.scale).reshape(-1, x.shape[-1])
            grad_weight = grad.reshape(-1, grad.shape[-1]).T @ dropped
        return grad_x, grad_weight, None


class DroppedInputLinear(InputDtypeLinear):
    """A LoRA A matrix that applies its layer's dropout (`dropout_p`) to its input itself."""

    dropout_p: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout_p == 0:
            return super().forward(x)
        if not torch.is_grad_enabled():  # nothing to keep for a backward pass
            return super().forward(F.dropout(x, self.dropout_p))
        return _DroppedProduct.apply(x, self.weight.to(x.dtype), self.dropout_p)


def fuse_lora_dropout(model: nn.Module) -> int:
    """Move the dropout of every plain LoRA linear layer of the PEFT `model` (no variant such as
    DoRA, no bias on the adapter, matrices already `InputDtypeLinear`) into its A matrix; returns
    how many layers changed."""
    from peft.tuners.lora import Linear as LoraLinear

    changed = 0
    for module in model.modules():
        if type(module) is not LoraLinear:
            continue
        for adapter, dropout in list(module.lora_dropout.items()):
            down = module.lora_A[adapter]
            plain = type(down) is InputDtypeLinear and down.bias is None
            plain = plain and adapter not in getattr(module, "lora_variant", {})
            if not plain or not isinstance(dropout, nn.Dropout) or dropout.p == 0:
                continue
            down.__class__ = DroppedInputLinear
            down.dropout_p = dropout.p
            module.lora_dropout[adapter] = nn.Identity()
            changed += 1
    return changed
