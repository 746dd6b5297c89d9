"""Sparse mixture-of-experts MLPs (Qwen3-MoE) in the family forward, read in place from
transformers' fused expert parameters.

A sparse layer's MLP is a router and a bank of experts. The router scores every expert with its
(E, H) weight, takes the softmax in float32, keeps the top k and renormalises them when the
config's `norm_topk_prob` says so, then rounds the weights to the model's dtype: the steps of
transformers' `Qwen3MoeTopKRouter`, so the same experts are chosen. The experts are two parameters,
`gate_up_proj` (E, 2I, H), gate rows first, and `down_proj` (E, H, I), read at every forward like
any other weight (no copy). Each token's k (token, expert) pairs are sorted by expert and each
projection runs as one grouped product over the sorted rows: `torch._grouped_mm` on CUDA in
bfloat16, with each expert's end row as an int32 cumulative count. Nothing there waits on the
host, so a decode step stays capturable in a CUDA graph. Elsewhere a loop over the experts that
have tokens does the same products (the reference; its loop reads the chosen experts on the host,
so a model on that path is decoded without graphs). LoRA adapters on the experts (PEFT's
`target_parameters`) add their low-rank products to each projection (`moe_adapters`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from grpoflow.kernels.ops import expert_order
from grpoflow.models.adapters import is_lora_layer
from grpoflow.models.moe_adapters import (
    ExpertAdapters,
    add_expert,
    add_grouped,
    base_experts,
    expert_adapters,
    expert_refusal,
)

SiluMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds every expert index and -1."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


def is_sparse(mlp: nn.Module) -> bool:
    """Whether a decoder layer's `mlp` is a router with experts (else a dense SwiGLU MLP)."""
    return hasattr(mlp, "experts")


def sparse_refusal(mlp: nn.Module, config) -> str | None:
    """Why the family forward cannot run the sparse MLP `mlp` as transformers does; None if it can."""
    router, wrapped = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    experts = base_experts(wrapped)
    if any(is_lora_layer(module) for module in [router, *experts.modules()]):
        return "LoRA adapters on the router (the family path adapts attention, dense MLPs and experts)"
    weight = getattr(router, "weight", None)
    if weight is None or weight.dim() != 2 or getattr(router, "bias", None) is not None:
        return "a router other than one (num_experts, hidden_size) weight without bias"
    num_experts, hidden = weight.shape
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "experts not stored as fused gate_up_proj and down_proj parameters (transformers >= 5)"
    layout = (getattr(experts, name, default) for name, default in _PLAIN_LAYOUT.items())
    if tuple(layout) != tuple(_PLAIN_LAYOUT.values()):
        return "an expert layout other than concatenated [gate; up] rows, untransposed, without bias"
    inter = down.shape[-1]
    if gate_up.shape != (num_experts, 2 * inter, hidden) or down.shape != (num_experts, hidden, inter):
        return f"expert weights of shapes {tuple(gate_up.shape)} and {tuple(down.shape)}"
    top_k = getattr(config, "num_experts_per_tok", 0)
    if not 1 <= top_k <= num_experts:
        return f"num_experts_per_tok={top_k} for {num_experts} experts"
    return expert_refusal(wrapped)


_PLAIN_LAYOUT = {"is_transposed": False, "is_concatenated": True, "has_bias": False, "has_gate": True}
"""transformers' `use_experts_implementation` flags of the one expert layout read here."""


@dataclass(slots=True)
class SparseMlp:
    """One sparse layer's router and experts (the policy's own modules) and how to run them."""

    router: nn.Module
    experts: nn.Module
    """The experts module itself (under PEFT's wrappers, if any: `wrapped`)."""
    wrapped: nn.Module
    """The layer's `mlp.experts`: the experts, or PEFT's wrapper of them."""
    top_k: int
    normalize: bool
    grouped: bool
    """Grouped products (`torch._grouped_mm`) rather than the reference loop."""
    index: int
    """The layer's place among the sparse layers: its row of a routing record."""
    adapters: ExpertAdapters = field(default_factory=ExpertAdapters)
    """The experts' LoRA adapters (`find_adapters`)."""

    def find_adapters(self) -> None:
        """Find the experts' adapters again, keeping the copies of those that stayed in place."""
        self.adapters = expert_adapters(self.wrapped, self.adapters)

    def __call__(self, x: torch.Tensor, silu_mul: SiluMul, routing: torch.Tensor | None) -> torch.Tensor:
        """The MLP's output for x (T, H); the chosen experts (T, k) go to `routing[index]` when given."""
        weights, chosen = route(x, self.router.weight, self.top_k, self.normalize)
        if routing is not None:
            routing[self.index].copy_(chosen)
        run = grouped_experts if self.grouped else reference_experts
        experts = self.experts
        return run(x, experts.gate_up_proj, experts.down_proj, chosen, weights, silu_mul, self.adapters)


def sparse_mlps(layers: list[nn.Module], config, grouped: bool) -> dict[int, SparseMlp]:
    """The sparse MLPs of `layers` by layer index (dense layers have none)."""
    sparse = [index for index, layer in enumerate(layers) if is_sparse(layer.mlp)]
    return {
        layer: SparseMlp(
            router=layers[layer].mlp.gate,
            experts=base_experts(layers[layer].mlp.experts),
            wrapped=layers[layer].mlp.experts,
            top_k=config.num_experts_per_tok,
            normalize=bool(getattr(config, "norm_topk_prob", False)),
            grouped=grouped,
            index=index,
        )
        for index, layer in enumerate(sparse)
    }


def route(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router: weights (T, k) in x's dtype and the chosen experts (T, k), best first."""
    probs = F.linear(x, weight).softmax(dim=-1, dtype=torch.float32)
    top, chosen = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(x.dtype), chosen


def grouped_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    silu_mul: SiluMul,
    adapters: ExpertAdapters | None = None,
) -> torch.Tensor:
    """The experts' weighted sum for each token as two grouped products over the (token, expert)
    pairs sorted by expert (and two more per adapter); shapes stay those of x, so a CUDA graph can
    capture it."""
    num_tokens, top_k = chosen.shape
    adapters = adapters or ExpertAdapters()
    order, offsets = expert_order(chosen, gate_up.shape[0])
    rows = x[order // top_k]
    products = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets)
    add_grouped(products, rows, adapters.gate_up, offsets)
    gate, up = products.chunk(2, dim=-1)
    activated = silu_mul(gate, up)
    out = torch._grouped_mm(activated, down.transpose(1, 2), offs=offsets)
    add_grouped(out, activated, adapters.down, offsets)
    by_token = torch.empty_like(out).index_copy_(0, order, out).view(num_tokens, top_k, -1)
    return (by_token * weights[..., None]).sum(dim=1)


def reference_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    silu_mul: SiluMul,
    adapters: ExpertAdapters | None = None,
) -> torch.Tensor:
    """The experts' weighted sum for each token, expert by expert as transformers' eager loop adds
    them (the same products and sums, in the same order; each adapter's product added to its
    projection's)."""
    adapters = adapters or ExpertAdapters()
    out = torch.zeros_like(x)
    for expert in torch.unique(chosen).tolist():
        tokens, slots = torch.nonzero(chosen == expert, as_tuple=True)
        rows = x[tokens]
        products = F.linear(rows, gate_up[expert])
        add_expert(products, rows, expert, adapters.gate_up)
        gate, up = products.chunk(2, dim=-1)
        activated = silu_mul(gate, up)
        projected = F.linear(activated, down[expert])
        add_expert(projected, activated, expert, adapters.down)
        product = projected * weights[tokens, slots, None]
        out[tokens] += product  # a token meets an expert once; `index_add_` crawls on busy CPUs
    return out
