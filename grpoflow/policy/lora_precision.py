"""LoRA adapters that keep float32 weights and multiply in the activations' dtype.

PEFT keeps a half-precision model's adapters in float32 (`autocast_adapter_dtype`), so that
small optimizer steps are not rounded away, and then runs every adapted layer's low-rank branch in
float32: it casts the layer's input to float32, applies dropout and both products there, and adds
the float32 result to the base output before casting the sum back. For a bfloat16 7B model with
adapters on every linear layer that is about 2 MB of float32 traffic per token and layer, more
than the products themselves cost (the 7B LoRA update ran at 25% of the bf16 peak).

`compute_in_input_dtype` turns a PEFT model's LoRA layers into what mixed precision (autocast)
makes of them: the input stays in its dtype, A and B are cast to it for their products (their
gradients still arrive in float32, on the float32 weights the optimizer steps), and the branch
adds to the base output in the base's dtype. A float32 model is unchanged by it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class InputDtypeLinear(nn.Linear):
    """A LoRA matrix held in its own dtype that multiplies in its input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


def compute_in_input_dtype(model: nn.Module) -> int:
    """Make every LoRA layer of the PEFT `model` run its adapters in the input's dtype (see the
    module's docstring); returns how many adapter matrices were changed."""
    from peft.tuners.lora import LoraLayer

    changed = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        matrices = [*module.lora_A.values(), *module.lora_B.values()]
        if not matrices or any(type(matrix) not in (nn.Linear, InputDtypeLinear) for matrix in matrices):
            continue  # a convolution's or an embedding's adapters keep PEFT's casting
        module.cast_input_dtype_enabled = False
        for matrix in matrices:
            changed += type(matrix) is nn.Linear
            matrix.__class__ = InputDtypeLinear
    return changed
