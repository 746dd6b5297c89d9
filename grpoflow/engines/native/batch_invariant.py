"""The family forward on the batch-invariant kernels (`NativeEngineConfig.batch_invariant`): the
policy's own modules' weights multiplied, normalised and attended by
`grpoflow.kernels.batch_invariant_ops.BatchInvariantOps` over the paged cache, so that every
token's logits are bit for bit those of the training forward with
`grpoflow.policy.batch_invariant` installed. Qwen2 and Llama layouts without sliding windows,
per-head norms, experts or LoRA layers; the projections run apart (never fused)."""

from __future__ import annotations

import torch
from torch import nn

from grpoflow.engines.native.adapters import is_lora_layer
from grpoflow.engines.native.model import FamilyModel, Fused, _window
from grpoflow.engines.native.model import refusal as family_refusal
from grpoflow.kernels.batch_invariant import matmul_forward
from grpoflow.kernels.batch_invariant_ops import rotary_tables

MODEL_TYPES = ("qwen2", "llama")
"""The model types whose forward the kernels have been checked to reproduce."""


def refusal(hf_model: nn.Module) -> str | None:
    """Why the batch-invariant forward cannot run `hf_model`; None when it can."""
    config = getattr(hf_model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model type {model_type!r} (batch_invariant covers {', '.join(MODEL_TYPES)})"
    reason = family_refusal(hf_model)
    if reason is not None:
        return reason
    layers = hf_model.model.layers
    if any(_window(config, index) for index in range(len(layers))):
        return "sliding-window attention"
    if hasattr(layers[0].self_attn, "q_norm"):
        return "per-head q/k norms"
    if any(is_lora_layer(module) for module in hf_model.modules()):
        return "LoRA layers (merge the adapters, or train without batch_invariant)"
    return None


class BatchInvariantFamily(FamilyModel):
    """`FamilyModel` whose products, rotary tables and logits are the kernels'."""

    linear = staticmethod(matmul_forward)

    def __init__(self, hf_model: nn.Module) -> None:
        reason = refusal(hf_model)
        if reason is not None:
            raise ValueError(f"batch_invariant cannot run this model: {reason}; set batch_invariant: false")
        super().__init__(hf_model)

    def fuse_projections(self) -> None:
        """Nothing to lay out: the projections run apart."""

    def refresh_fused(self) -> None:
        self.refresh_adapters()
        self.fused = [Fused() for _ in self.layers]

    def build_rotary_tables(self, max_len: int) -> None:
        """The rows 0..max_len of the table the training forward indexes (`rotary_tables`)."""
        cos, sin = rotary_tables(self.hf_model.model.rotary_emb, self.device)
        if max_len > cos.shape[0]:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's max_position_embeddings {cos.shape[0]}"
            )
        self.rotary = [(cos[:max_len].to(self.dtype), sin[:max_len].to(self.dtype))]

    def logits(
        self, normed: torch.Tensor, last_index: torch.Tensor | None, logits_out: torch.Tensor | None
    ) -> torch.Tensor:
        if last_index is not None:
            normed = normed[last_index]
        logits = matmul_forward(normed, self.lm_head.weight, self.lm_head.bias)
        return logits if logits_out is None else logits_out.copy_(logits)
