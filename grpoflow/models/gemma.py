"""Gemma 3 (text) in the family forward, read in place from transformers' `Gemma3ForCausalLM`.

Gemma 3 has the Llama layout's projections (q/k/v/o, gate/up/down, so the fused views, LoRA
adapters and paged cache are the family's own) with these differences, each computed as
transformers computes it: embeddings scaled by sqrt(hidden_size) in the embedding dtype; RMSNorm
with `1 + weight` applied in float32 before the cast; four norms per layer (input,
post-attention, pre- and post-feedforward), the residual added after the post norms; per-head q/k
norms; a `gelu_pytorch_tanh` MLP; attention scaled by `query_pre_attn_scalar ** -0.5`; sliding
window layers (`layer_types`, `sliding_window`) with their own rotary table and full attention
layers with theirs (`rope_parameters` by layer type); final logit soft-capping when configured.
Every position stays in the cache; a sliding layer's attention masks what lies outside its window,
so cached prefix blocks are shared as for any model. Variants outside this (attention logit
soft-capping, bidirectional attention, another activation or rotary type) go to the generic path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from grpoflow.kernels.ops import TorchOps
from grpoflow.models.adapters import add_low_rank, is_lora_layer, supported
from grpoflow.models.model import (
    SUPPORTED_ROPE_TYPES,
    Attend,
    FamilyModel,
    dense_mlp,
    eps_of,
    rotary_table,
)

GEMMA_MODEL_TYPES = ("gemma3_text",)
LAYER_TYPES = ("sliding_attention", "full_attention")
ACTIVATIONS = ("gelu_pytorch_tanh",)
LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class GemmaModel(FamilyModel):
    """The family forward over a live Gemma 3 text model."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__(hf_model)
        self.layer_types = list(self.config.layer_types)
        self.softcap = getattr(self.config, "final_logit_softcapping", None)

    def build_rotary_tables(self, max_len: int) -> None:
        """One table per layer type, each from transformers' own inverse frequencies and scaling."""
        rotary = self.hf_model.model.rotary_emb
        kinds = sorted(set(self.layer_types))
        self.rotary = [
            rotary_table(
                getattr(rotary, f"{kind}_inv_freq"),
                float(getattr(rotary, f"{kind}_attention_scaling", 1.0)),
                max_len,
                self.device,
                self.dtype,
            )
            for kind in kinds
        ]
        self.rotary_of = [kinds.index(kind) for kind in self.layer_types]

    def forward(
        self,
        input_ids: torch.Tensor,
        attend: Attend,
        ops: type[TorchOps],
        last_index: torch.Tensor | None = None,
        logits_out: torch.Tensor | None = None,
        routing: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As `FamilyModel.forward` (Gemma 3 has no experts: `routing` is never written)."""
        weight = self.embed.weight
        hidden = F.embedding(input_ids, weight) * self.embed.embed_scale.to(weight.dtype)
        residual = None
        for index, layer in enumerate(self.layers):
            normed, residual = _norm(ops, hidden, layer.input_layernorm, residual)
            hidden = self._attention(index, layer.self_attn, normed, attend, ops)
            hidden, _ = _norm(ops, hidden, layer.post_attention_layernorm)
            normed, residual = _norm(ops, hidden, layer.pre_feedforward_layernorm, residual)
            hidden = dense_mlp(normed, layer.mlp, self.fused[index], self.adapters[index], ops.gelu_mul)
            hidden, _ = _norm(ops, hidden, layer.post_feedforward_layernorm)
        normed, _ = _norm(ops, hidden, self.norm, residual)
        logits = self.logits(normed, last_index, logits_out)
        if self.softcap is not None:  # in place: the logits may be a captured graph's buffer
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def _attention(
        self, index: int, attention: nn.Module, normed: torch.Tensor, attend: Attend, ops: type[TorchOps]
    ) -> torch.Tensor:
        """The attention block's output (T, H): q/k/v, their head norms, `attend`, then o_proj."""
        shape, adapters = self.shape, self.adapters[index]
        q, k, v = self.qkv(normed, attention, self.fused[index], adapters)
        q, k = _head_norm(ops, q, attention.q_norm), _head_norm(ops, k, attention.k_norm)
        out = attend(index, q, k, v, None).reshape(normed.shape[0], shape.num_heads * shape.head_dim)
        hidden = F.linear(out, attention.o_proj.weight, attention.o_proj.bias)
        add_low_rank([hidden], out, [adapters.o])
        return hidden


def _norm(
    ops: type[TorchOps], x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.rms_norm(x, norm.weight, eps_of(norm), residual, unit_offset=True)


def _head_norm(ops: type[TorchOps], x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """Gemma's norm over each head of x (T, H, D), as a new contiguous tensor."""
    normed, _ = _norm(ops, x.reshape(-1, x.shape[-1]), norm)
    return normed.view(x.shape)


def gemma_refusal(hf_model: nn.Module) -> str | None:
    """Why the Gemma forward cannot run `hf_model` as transformers does; None when it can."""
    config = hf_model.config
    activation = getattr(config, "hidden_activation", None)
    if activation not in ACTIVATIONS:
        return f"hidden_activation {activation!r} (the family path has {', '.join(ACTIVATIONS)})"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attn_logit_softcapping is set (the family path does not soft-cap attention scores)"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention is set (the family path attends causally)"
    layer_types = list(getattr(config, "layer_types", None) or [])
    if not layer_types or not set(layer_types) <= set(LAYER_TYPES):
        return f"layer_types {sorted(set(layer_types))} (the family path has {', '.join(LAYER_TYPES)})"
    rope = getattr(config, "rope_parameters", None) or {}
    for kind in sorted(set(layer_types)):
        rope_type = (rope.get(kind) or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            return f"rope_type {rope_type!r} of the {kind} layers (the family path has {', '.join(SUPPORTED_ROPE_TYPES)})"
    return _layout_refusal(hf_model, sorted(set(layer_types)))


def _layout_refusal(hf_model: nn.Module, kinds: list[str]) -> str | None:
    inner = getattr(hf_model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    layers = getattr(inner, "layers", None)
    if (
        not hasattr(hf_model, "lm_head")
        or not hasattr(getattr(inner, "embed_tokens", None), "embed_scale")
        or not hasattr(inner, "norm")
        or not all(hasattr(rotary, f"{kind}_inv_freq") for kind in kinds)
        or layers is None
        or not all(_has_gemma_layout(layer) for layer in layers)
    ):
        return (
            "a module layout other than transformers' Gemma 3 (model.embed_tokens with embed_scale, "
            "layers with four norms and q/k norms, norm, rotary_emb by layer type; lm_head)"
        )
    if is_lora_layer(inner.embed_tokens) or not all(supported(m) for m in hf_model.modules()):
        return "LoRA adapters the family forward does not apply (a variant, a bias, embeddings)"
    return None


def _has_gemma_layout(layer: nn.Module) -> bool:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    parts = [(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    parts += [(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")]
    parts += [(layer, name) for name in LAYER_NORMS]
    return all(hasattr(owner, name) for owner, name in parts)
