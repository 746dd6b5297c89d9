"""The routers' load-balancing loss of a mixture-of-experts model (Switch Transformer's, eq. 4-6),
as transformers' Qwen-MoE, OLMoE and Mixtral models define it, in memory linear in the tokens.

Over every layer's routed tokens (those the mask keeps): f_e, the fraction of top-k assignments
that go to expert e (counted, no gradient), and P_e, the mean router probability of e; the loss is
num_experts * sum_e f_e P_e. transformers' own function builds a one-hot (layers x tokens, top_k,
experts) tensor and an expanded mask of that shape (2.4 GB at 8 layers of 128 experts, 8 per token,
and 25K tokens). Here each layer adds its counts (a scatter) and its probability sums in turn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def load_balancing_loss(
    router_logits: Sequence[Tensor], num_experts: int, top_k: int, token_mask: Tensor | None = None
) -> Tensor:
    """The loss of the layers' router logits, each (tokens, num_experts) in one token order;
    `token_mask` (any shape of `tokens` elements, 1 on tokens that count) or None for all."""
    if not router_logits:
        raise ValueError("the load-balancing loss needs the router logits of at least one layer")
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probability_sums = torch.zeros(num_experts, dtype=torch.float32, device=device)
    weights = None if token_mask is None else token_mask.reshape(-1).to(device, torch.float32)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probabilities = torch.softmax(logits.to(device).float(), dim=-1)
        chosen = torch.topk(probabilities, top_k, dim=-1).indices.reshape(-1)
        if weights is None:
            counts = counts + torch.bincount(chosen, minlength=num_experts).float()
            probability_sums = probability_sums + probabilities.sum(0)
            rows = rows + probabilities.shape[0]
        else:
            counts = counts.scatter_add(0, chosen, weights.repeat_interleave(top_k))
            probability_sums = probability_sums + (probabilities * weights[:, None]).sum(0)
            rows = rows + weights.sum()
    return num_experts * torch.sum((counts / rows) * (probability_sums / rows))
