"""Entropy in the loss: a bonus that keeps the policy exploring, and the high-entropy token mask.

- Entropy bonus (`entropy_coef`): the loss becomes `L_policy - entropy_coef * H`, with `H` the mean
  per-token entropy of the tokens the policy loss acts on, whatever the loss type's own
  normalisation (TRL 1.16's definition). Under gradient accumulation each micro-batch's `H` is
  divided by the number of micro-batches.
- Adaptive control (Skywork-OR1, `use_adaptive_entropy`): after each optimizer step the
  coefficient rises by `entropy_coef_delta` when the step's entropy is at or below
  `entropy_target` and falls otherwise, within `[entropy_coef_min, entropy_coef_max]`; the bonus
  applies only while the last step's entropy is at or below the target (none before the first).
- High-entropy tokens (Beyond the 80/20 Rule, `top_entropy_quantile` rho): only tokens whose
  entropy reaches the `1 - rho` quantile of the micro-batch's completion tokens carry policy loss.
  TRL takes the quantile over the micro-batches of every process at once; here it is taken over
  the micro-batch of one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def entropy_bonus(entropies: Tensor, mask: Tensor) -> Tensor:
    """Mean entropy over the tokens of `mask`, `(batch, seq)` each; 0-dim, with `entropies`' grad."""
    mask = mask.to(entropies.dtype)
    return (entropies * mask).sum() / mask.sum().clamp(min=1.0)


def high_entropy_mask(entropies: Tensor, mask: Tensor, top_entropy_quantile: float) -> Tensor:
    """1 on the tokens of `mask` whose entropy is at least the `1 - top_entropy_quantile` quantile
    of the masked entropies, else 0; `(batch, seq)` float, no grad.

    Example: entropies `[[0.1, 0.5, 0.9, 0.3]]`, all tokens, quantile 0.5: the median is 0.4, so
    the mask is `[[0, 1, 1, 0]]`.
    """
    with torch.no_grad():
        valid = mask.bool()
        counted = entropies[valid].float()
        if counted.numel() == 0:
            return torch.zeros_like(mask, dtype=entropies.dtype)
        threshold = torch.quantile(counted, 1.0 - top_entropy_quantile)
        return ((entropies * valid >= threshold) & valid).to(entropies.dtype)


@dataclass(kw_only=True, slots=True)
class AdaptiveEntropy:
    """The entropy coefficient as it changes over optimizer steps (static unless `adaptive`)."""

    coef: float
    """The coefficient now."""
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    coef_min: float = 0.0
    coef_max: float = 1.0
    last_entropy: float = math.inf
    """Entropy of the last optimizer step (inf before the first: no adaptive bonus yet)."""

    @property
    def enabled(self) -> bool:
        """Whether the loss carries an entropy term at all."""
        return self.coef != 0.0 or self.adaptive

    def applied_coef(self) -> float:
        """The coefficient for this step's micro-batches."""
        if not self.adaptive:
            return self.coef
        return self.coef if self.last_entropy <= self.target else 0.0

    def state_dict(self) -> dict[str, float]:
        """What moves during a run (for checkpoints)."""
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        """Where a checkpointed run left the coefficient (None: a checkpoint without it)."""
        if state is not None:
            self.coef, self.last_entropy = state["coef"], state["last_entropy"]

    def step(self, entropy: float) -> None:
        """After an optimizer step whose token-mean entropy was `entropy`."""
        if not self.adaptive:
            return
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = entropy
