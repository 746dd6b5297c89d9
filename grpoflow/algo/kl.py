"""KL estimators between the policy and a reference policy, per token."""

from __future__ import annotations

import torch
from torch import Tensor


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(policy || reference) for tokens sampled from the policy.

    `exp(ref - logp) - (ref - logp) - 1`: unbiased, always >= 0, and 0 where the two agree.

    Args:
        logps: `(batch, seq)` policy log-probabilities of the sampled tokens.
        ref_logps: `(batch, seq)` reference log-probabilities of the same tokens.

    Returns:
        `(batch, seq)` per-token estimates; mask padding before reducing.
    """
    log_ratio = ref_logps - logps
    return torch.exp(log_ratio) - log_ratio - 1
