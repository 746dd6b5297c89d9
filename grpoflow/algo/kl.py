"""KL estimators between the policy and a reference policy, per sampled token (Schulman 2020).

With `d = ref - logp` for a token sampled from the policy:
- `k1`: `-d`, unbiased, high variance, can be negative.
- `k2`: `d^2 / 2`, biased, non-negative; its gradient is the true KL gradient to first order.
- `k3`: `exp(d) - d - 1`, unbiased and non-negative (TRL's and the GRPO paper's estimator).
- `low_var_kl`: k3 with `d` clamped to [-20, 20] and the result to [-10, 10], as verl computes it,
  so that one token far off the reference cannot dominate the penalty.

In the loss each estimate is a per-token penalty; with `kl_in_reward` the sum over a completion's
tokens, times `beta`, is subtracted from its reward before advantages (`sequence_kl`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def k1_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """`logp - ref`: the log-ratio itself."""
    return logps - ref_logps


def k2_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """`(logp - ref)^2 / 2`."""
    return 0.5 * (logps - ref_logps).square()


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


def low_var_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k3 on the log-ratio clamped to [-20, 20], clamped to [-10, 10]."""
    log_ratio = torch.clamp(ref_logps - logps, -20.0, 20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": k1_kl,
    "k2": k2_kl,
    "k3": k3_kl,
    "low_var_kl": low_var_kl,
}
"""`(logps (batch, seq), ref_logps (batch, seq)) -> per-token KL (batch, seq)`, by `kl_estimator` name."""


def kl_estimate(logps: Tensor, ref_logps: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL `(batch, seq)` by the estimator `KL_ESTIMATORS[estimator]`."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"Unknown kl_estimator {estimator!r}; known: {sorted(KL_ESTIMATORS)}.")
    return KL_ESTIMATORS[estimator](logps, ref_logps)


def sequence_kl(logps: Tensor, ref_logps: Tensor, mask: Tensor, estimator: str = "k3") -> Tensor:
    """Each completion's KL: the sum of its tokens' estimates, `(batch,)`.

    Args:
        logps, ref_logps: `(batch, seq)` log-probs of the sampled tokens under the policy that
            sampled them and under the reference.
        mask: `(batch, seq)`, 1 on the tokens that count.
    """
    per_token = kl_estimate(logps, ref_logps, estimator)
    return (per_token * mask.to(per_token.dtype)).sum(dim=-1)
