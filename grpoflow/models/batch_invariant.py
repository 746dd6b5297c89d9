"""The family forward on the batch-invariant kernels (`NativeEngineConfig.batch_invariant`): the
policy's own modules' weights multiplied, normalised and attended by
`grpoflow.kernels.batch_invariant_ops.BatchInvariantOps` over the paged cache, so that every
token's logits are bit for bit those of the training forward with
`grpoflow.policy.batch_invariant` installed. Qwen2, Llama, Qwen3 and Qwen3-MoE layouts without
sliding windows, with plain LoRA layers but no LoRA dropout (none on the experts). A sparse
layer's router and experts run `grpoflow.kernels.batch_invariant_moe`'s `route` and `experts`,
which the training forward's sparse blocks call too (`InvariantSparseMlp`). q/k/v and gate/up run as one
product each where their weights lie back to back (`grpoflow.models.fusion`): the kernel sums each
output column over the same blocks of the input whatever other columns share the product, so a
fused product's columns are the separate products' bit for bit (a decode step's narrow k and v
products otherwise fill a few of the GPU's processors)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import nn

from grpoflow.kernels import batch_invariant_moe as bi_moe
from grpoflow.kernels.batch_invariant import matmul_forward
from grpoflow.kernels.batch_invariant_ops import rotary_tables
from grpoflow.models.adapters import Projection, is_lora_layer
from grpoflow.models.model import FamilyModel, _window
from grpoflow.models.model import refusal as family_refusal
from grpoflow.models.moe import SiluMul, SparseMlp

MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen3_moe")
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
    if any(_window(config, index) for index in range(len(hf_model.model.layers))):
        return "sliding-window attention"
    for module in filter(is_lora_layer, hf_model.modules()):
        if type(module).__name__ == "ParamWrapper":
            return (
                "LoRA adapters on the experts (target_parameters: PEFT adds them to the expert weights, "
                "the engine to the products; drop target_parameters)"
            )
        if type(module).__name__ != "Linear":
            return f"LoRA layers of kind {type(module).__name__} (batch_invariant covers PEFT's LoRA Linear)"
        if not all(isinstance(dropout, nn.Identity) for dropout in module.lora_dropout.values()):
            return "LoRA dropout (set lora_dropout: 0)"
    return None


def add_low_rank(
    outputs: Sequence[torch.Tensor],
    x: torch.Tensor,
    projections: Sequence[Projection],
    down: torch.Tensor | None = None,
) -> None:
    """PEFT's LoRA forward on the kernels, op for op: each output (the base product) plus every
    adapter's `B(A(x)) * scale` in turn, x cast to A's dtype first where the layer casts it, A and
    B cast to their input's dtype and multiplied by `matmul_forward`, the sum rounded to the
    output's dtype once. `down` is unused: each adapter's A multiplies on its own."""
    for out, projection in zip(outputs, projections):
        result, inputs = out, x
        for term in projection.terms:
            inputs = inputs.to(term.down.weight.dtype) if term.cast_input else inputs
            part = matmul_forward(inputs, term.down.weight.to(inputs.dtype))
            result = result + matmul_forward(part, term.up.weight.to(part.dtype)) * term.scale
        if result is not out:
            out.copy_(result)


@dataclass(slots=True)
class InvariantSparseMlp(SparseMlp):
    """A sparse layer on the kernels: the router's logits by `matmul_forward`, then
    `batch_invariant_moe.route` and `batch_invariant_moe.experts` (their own SiLU; no host sync on
    CUDA, so a decode step stays capturable in a graph)."""

    @staticmethod
    def of(mlp: SparseMlp) -> InvariantSparseMlp:
        """`mlp`'s router and experts on the kernels; grouped (graph-safe) on CUDA."""
        values = {field.name: getattr(mlp, field.name) for field in fields(mlp)}
        return InvariantSparseMlp(**{**values, "grouped": mlp.router.weight.is_cuda})

    def __call__(self, x: torch.Tensor, silu_mul: SiluMul, routing: torch.Tensor | None) -> torch.Tensor:
        """The MLP's output for x (T, H); the chosen experts (T, k) go to `routing[index]` when given."""
        logits = matmul_forward(x, self.router.weight)
        weights, chosen = bi_moe.route(logits, self.top_k, self.normalize)
        if routing is not None:
            routing[self.index].copy_(chosen)
        return bi_moe.experts(x, self.experts.gate_up_proj, self.experts.down_proj, chosen, weights)


class BatchInvariantFamily(FamilyModel):
    """`FamilyModel` whose products, adapters, rotary tables and logits are the kernels'."""

    linear = staticmethod(matmul_forward)
    low_rank = staticmethod(add_low_rank)

    def __init__(self, hf_model: nn.Module) -> None:
        reason = refusal(hf_model)
        if reason is not None:
            raise ValueError(f"batch_invariant cannot run this model: {reason}; set batch_invariant: false")
        super().__init__(hf_model)
        self.sparse = {index: InvariantSparseMlp.of(mlp) for index, mlp in self.sparse.items()}

    def load_adapters(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], **kwargs) -> None:
        """Weights alone: adapters sent as tensors come with B scaled, unlike the training forward."""
        if adapters:
            raise ValueError(
                "batch_invariant takes no adapters sent as tensors: send merged weights, or set "
                "batch_invariant: false"
            )
        super().load_adapters(adapters, **kwargs)

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
        add_low_rank([logits], normed, [self.head_adapters])
        return logits if logits_out is None else logits_out.copy_(logits)
