"""Truncated sampling (top-k, top-p, min-p) as one threshold per row, and log-probs under it.

An engine that samples with top-k, top-p or min-p draws from the distribution renormalised over
the tokens that survive the filters, and reports the sampled token's log-prob under it (vLLM's
`processed_logprobs`, the native engine). A trainer that scores the same token over the whole
vocabulary gets `log p - log S`, S the surviving mass, so an importance ratio between the two is
off by S at every token (TRL #6789). Replaying the filters on the trainer's own logits puts both
log-probs on the same support (prime-rl's trainer-side replay): the tokens kept are those whose
scaled logit reaches the row's threshold, and the sampled token is always kept, so a token that
the trainer's rounding puts just outside the engine's set still has a finite log-prob.

Order and ties follow vLLM: top-p is taken over the top-k survivors renormalised; min-p against
the full distribution's top probability; every token tied with the threshold stays in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Truncation:
    """The filters of truncated sampling; top_k <= 0, top_p 1 and min_p 0 are off."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    def thresholds(self, scaled: Tensor) -> Tensor | None:
        """`(rows, vocab)` temperature-scaled logits -> `(rows,)` smallest scaled logit still in
        the draw, or None when no filter is on."""
        if not self.active:
            return None
        vocab_size = scaled.shape[-1]
        thresholds = torch.full(scaled.shape[:1], -torch.inf, device=scaled.device)
        if self.top_p < 1:
            ordered = scaled.sort(dim=-1, descending=True).values
            if 0 < self.top_k < vocab_size:
                ordered[:, self.top_k :] = -torch.inf
            probs = ordered.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            keep = (mass_before < self.top_p).sum(dim=-1).clamp(min=1)
            thresholds = ordered.gather(1, (keep - 1)[:, None])[:, 0]
        elif 0 < self.top_k < vocab_size:
            thresholds = scaled.topk(self.top_k, dim=-1).values[:, -1]
        if self.min_p > 0:
            floor = scaled.max(dim=-1).values + math.log(self.min_p)
            thresholds = torch.maximum(thresholds, floor)
        return thresholds

    def kept(self, scaled: Tensor, targets: Tensor | None = None) -> Tensor | None:
        """`(rows, vocab)` bool mask of the tokens in the draw (each row's target too), or None
        when no filter is on. Computed without gradient: the support is taken as given."""
        with torch.no_grad():
            thresholds = self.thresholds(scaled.detach())
            if thresholds is None:
                return None
            kept = scaled.detach() >= thresholds[:, None]
            if targets is not None:
                kept.scatter_(1, targets[:, None], True)
            return kept


def truncated_scores(scaled: Tensor, truncation: Truncation | None, targets: Tensor) -> Tensor:
    """`scaled` with the tokens outside the draw at -inf (a new tensor), or `scaled` itself."""
    kept = truncation.kept(scaled, targets) if truncation is not None else None
    return scaled if kept is None else scaled.masked_fill(~kept, -torch.inf)
