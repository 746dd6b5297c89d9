"""A tiny random Qwen3-MoE and its routers' own choices, for the routing-replay tests."""

from __future__ import annotations

import torch

from grpoflow.policy.routing_replay import moe_routers
from grpoflow.policy.tiny import PRESETS, build_tiny_model

VOCAB = 40


def tiny_moe(seed: int = 0, **overrides) -> torch.nn.Module:
    """Qwen3-MoE: hidden 64, 2 layers, 8 experts, 2 per token."""
    return build_tiny_model(VOCAB, seed=seed, **{**PRESETS["tiny-moe"], **overrides})


def own_routing(model, input_ids: torch.Tensor) -> torch.Tensor:
    """(tokens, layers, top_k) the experts the model's routers choose for `input_ids`."""
    chosen: dict[int, torch.Tensor] = {}
    routers = moe_routers(model).routers
    handles = [
        router.register_forward_hook(lambda m, a, out, layer=layer: chosen.__setitem__(layer, out[2]))
        for layer, router in enumerate(routers)
    ]
    with torch.no_grad():
        model(input_ids=input_ids)
    for handle in handles:
        handle.remove()
    return torch.stack([chosen[layer] for layer in range(len(routers))], dim=1)


def other_experts(own: torch.Tensor, num_experts: int = 8) -> torch.Tensor:
    """For each token (and layer), top_k experts none of which the router chose itself."""
    flat = own.reshape(-1, own.shape[-1])
    other = torch.empty_like(flat)
    for index, experts in enumerate(flat.tolist()):
        free = [e for e in range(num_experts) if e not in experts]
        other[index] = torch.tensor(free[: own.shape[-1]])
    return other.view_as(own)
