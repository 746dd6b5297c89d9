"""The routers of a mixture-of-experts policy during a training forward pass: routing replay, the
routing mismatch against the engine and the router's load-balancing loss.

Each MoE layer's router runs as the model has it (logits, softmax); a hook on it then sends every
token the engine recorded (`RolloutBatch.routed_experts`, all `top_k` experts >= 0) to the
engine's experts instead of the router's own top-k, so the training forward computes the
completion the engine sampled. The experts' weights are still the router's own softmax
probabilities at those experts (renormalised over them when the model's config says so), so the
router keeps its gradient. Tokens without a record use the router's own choice.

Covered: the softmax top-k routers of transformers' Qwen2-MoE, Qwen3-MoE, Qwen3-Next, OLMoE and
Mixtral (`ROUTERS`); the hook works whatever the experts' implementation (eager, grouped_mm,
batched_mm), which reads only the router's output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from grpoflow.algo.load_balancing import load_balancing_loss

ROUTERS = frozenset(
    {
        "Qwen2MoeTopKRouter",
        "Qwen3MoeTopKRouter",
        "Qwen3NextTopKRouter",
        "OlmoeTopKRouter",
        "MixtralTopKRouter",
    }
)
"""Router classes that score experts by a softmax over `weight @ hidden` and keep the top k."""
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Config fields of a model's routed expert count (a model with one > 0 is a MoE model)."""


def is_moe_config(config) -> bool:
    """The (text) config describes a mixture-of-experts model."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any((getattr(config, name, None) or 0) > 0 for name in EXPERT_COUNT_KEYS)


@dataclass(slots=True)
class RoutingRecord:
    """One forward pass's routing: the engine's experts it replays, and what it saw."""

    replay: bool = False
    """Replay the bound experts (False: the router's own choice everywhere)."""
    keep_logits: bool = False
    """Keep every layer's router logits (for the load-balancing loss)."""
    routed: torch.Tensor | None = None
    """(tokens, num_moe_layers, top_k) the engine's experts of the tokens in forward order."""
    token_mask: torch.Tensor | None = None
    """The forward's (rows, columns) real tokens for the load-balancing loss; None: all real."""
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    """Layer -> (tokens, num_experts) router logits, under `keep_logits`."""
    mismatches: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Layer -> (tokens whose own top-k set differs from the engine's, tokens recorded)."""

    def bind(self, routed: torch.Tensor | None, token_mask: torch.Tensor | None) -> None:
        """The experts (in the forward's token order) and the real-token mask of the next forward."""
        self.routed = routed if self.replay else None
        self.token_mask = token_mask

    def mismatch_fraction(self) -> torch.Tensor | None:
        """Fraction of the recorded (token, layer) routings whose router's own top-k set differs
        from the engine's; None when nothing was recorded."""
        if not self.mismatches:
            return None
        differ = torch.stack([pair[0] for pair in self.mismatches.values()]).sum()
        total = torch.stack([pair[1] for pair in self.mismatches.values()]).sum()
        return differ.float() / total.clamp(min=1).float()


@dataclass(slots=True)
class MoeRouters:
    """A mixture-of-experts model's routers in layer order, and its load-balancing loss."""

    routers: list[nn.Module]
    num_experts: int
    top_k: int
    default_aux_loss_coef: float
    """The model config's `router_aux_loss_coef` (0 when it has none)."""

    @contextmanager
    def hooked(self, record: RoutingRecord) -> Iterator[RoutingRecord]:
        """Every router reports to (and replays from) `record` until the block exits: keep it
        open over the backward pass too, where gradient checkpointing runs the routers again."""
        layers = len(self.routers)
        handles = [
            router.register_forward_hook(_hook(layer, layers, record))
            for layer, router in enumerate(self.routers)
        ]
        try:
            yield record
        finally:
            for handle in handles:
                handle.remove()

    def aux_loss(self, record: RoutingRecord) -> torch.Tensor:
        """The load-balancing loss of the forward `record` kept the logits of. It takes them out of
        the record and keeps no more: under gradient checkpointing the routers run again in the
        backward pass, and logits kept from that recomputation would hold its whole graph (every
        layer's activations up to its router) until the record goes."""
        logits = tuple(record.logits.pop(layer) for layer in sorted(record.logits))
        if not logits:
            raise ValueError("the load-balancing loss needs the router logits: record with keep_logits=True")
        record.keep_logits = False
        return load_balancing_loss(logits, self.num_experts, self.top_k, record.token_mask)


def moe_routers(model: nn.Module) -> MoeRouters | None:
    """The routers of `model` (`ROUTERS`), or None for a model without them. A MoE model whose
    routers are of another kind is an error only where their replay is asked for."""
    routers = [module for module in model.modules() if type(module).__name__ in ROUTERS]
    if not routers:
        return None
    first = routers[0]
    config = getattr(model, "config", None)
    return MoeRouters(
        routers=routers,
        num_experts=first.num_experts,
        top_k=first.top_k,
        default_aux_loss_coef=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0),
    )


def _hook(layer: int, layers: int, record: RoutingRecord) -> Callable:
    def hook(router: nn.Module, args: tuple, output: tuple) -> tuple | None:
        logits, scores, own = output
        if record.keep_logits:
            record.logits[layer] = logits
        if record.routed is None:
            return None
        expected = (own.shape[0], layers, own.shape[1])
        if tuple(record.routed.shape) != expected:
            raise ValueError(
                f"the recorded routing has shape {tuple(record.routed.shape)}; this forward needs "
                f"{expected} (tokens, MoE layers, top_k): record it with the policy's model"
            )
        return _replayed(router, layer, record, logits, scores.dtype, own)

    return hook


def _replayed(
    router: nn.Module,
    layer: int,
    record: RoutingRecord,
    logits: torch.Tensor,
    dtype: torch.dtype,
    own: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's output with the recorded experts where recorded: (logits, weights, experts)."""
    recorded = record.routed[:, layer].to(device=own.device, dtype=torch.long)
    replayed = (recorded >= 0).all(dim=-1, keepdim=True)
    experts = torch.where(replayed, recorded, own)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    with torch.no_grad():
        differ = (own.sort(dim=-1).values != recorded.sort(dim=-1).values).any(dim=-1) & replayed[:, 0]
        record.mismatches[layer] = (differ.sum(), replayed.sum())
    return logits, weights.to(dtype), experts
