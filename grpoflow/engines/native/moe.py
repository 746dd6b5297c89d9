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
so a model on that path is decoded without graphs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from grpoflow.engines.native.adapters import is_lora_layer

SiluMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def is_sparse(mlp: nn.Module) -> bool:
    """Whether a decoder layer's `mlp` is a router with experts (else a dense SwiGLU MLP)."""
    return hasattr(mlp, "experts")


def sparse_refusal(mlp: nn.Module, config) -> str | None:
    """Why the family forward cannot run the sparse MLP `mlp` as transformers does; None if it can."""
    if any(is_lora_layer(module) for module in mlp.modules()):
        return "LoRA adapters on the router or the experts (the family path adapts attention and dense MLPs)"
    router, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
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
    return None


_PLAIN_LAYOUT = {"is_transposed": False, "is_concatenated": True, "has_bias": False, "has_gate": True}
"""transformers' `use_experts_implementation` flags of the one expert layout read here."""


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` multiplies `dtype` on `device` without host syncs: CUDA, bfloat16,
    compute capability 8.0 or later (9.x for torch before 2.9)."""
    if device.type != "cuda" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    major, _ = torch.cuda.get_device_capability(device)
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    return major == 9 or (major >= 8 and version >= (2, 9))


@dataclass(slots=True)
class SparseMlp:
    """One sparse layer's router and experts (the policy's own modules) and how to run them."""

    router: nn.Module
    experts: nn.Module
    top_k: int
    normalize: bool
    grouped: bool
    """Grouped products (`torch._grouped_mm`) rather than the reference loop."""
    index: int
    """The layer's place among the sparse layers: its row of a routing record."""

    def __call__(self, x: torch.Tensor, silu_mul: SiluMul, routing: torch.Tensor | None) -> torch.Tensor:
        """The MLP's output for x (T, H); the chosen experts (T, k) go to `routing[index]` when given."""
        weights, chosen = route(x, self.router.weight, self.top_k, self.normalize)
        if routing is not None:
            routing[self.index].copy_(chosen)
        run = grouped_experts if self.grouped else reference_experts
        return run(x, self.experts.gate_up_proj, self.experts.down_proj, chosen, weights, silu_mul)


def sparse_mlps(layers: list[nn.Module], config, grouped: bool) -> dict[int, SparseMlp]:
    """The sparse MLPs of `layers` by layer index (dense layers have none)."""
    sparse = [index for index, layer in enumerate(layers) if is_sparse(layer.mlp)]
    return {
        layer: SparseMlp(
            router=layers[layer].mlp.gate,
            experts=layers[layer].mlp.experts,
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
) -> torch.Tensor:
    """The experts' weighted sum for each token as two grouped products over the (token, expert)
    pairs sorted by expert; shapes stay those of x, so a CUDA graph can capture it."""
    num_tokens, top_k = chosen.shape
    order = torch.argsort(chosen.reshape(-1), stable=True)
    ends = torch.arange(1, gate_up.shape[0] + 1, device=x.device, dtype=chosen.dtype)
    offsets = torch.searchsorted(chosen.reshape(-1)[order], ends, out_int32=True)
    products = torch._grouped_mm(x[order // top_k], gate_up.transpose(1, 2), offs=offsets)
    gate, up = products.chunk(2, dim=-1)
    out = torch._grouped_mm(silu_mul(gate, up), down.transpose(1, 2), offs=offsets)
    by_token = torch.empty_like(out).index_copy_(0, order, out).view(num_tokens, top_k, -1)
    return (by_token * weights[..., None]).sum(dim=1)


def reference_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    silu_mul: SiluMul,
) -> torch.Tensor:
    """The experts' weighted sum for each token, expert by expert as transformers' eager loop adds
    them (the same products and sums, in the same order)."""
    out = torch.zeros_like(x)
    for expert in torch.unique(chosen).tolist():
        tokens, slots = torch.nonzero(chosen == expert, as_tuple=True)
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        product = F.linear(silu_mul(gate, up), down[expert]) * weights[tokens, slots, None]
        out[tokens] += product  # a token meets an expert once; `index_add_` crawls on busy CPUs
    return out
