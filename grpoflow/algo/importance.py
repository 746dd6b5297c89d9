"""Importance-sampling correction for rollouts the trainer's policy did not sample itself.

When the engine that sampled a completion is not the trainer's policy (a separate vLLM copy of the
weights, kernels that round differently, or an older policy version under asynchronous
generation), the surrogate loss is reweighted by `pi_trainer(token) / pi_sampler(token)`: TRL's
`vllm_importance_sampling_*` correction (truncated importance sampling, Yao et al. 2025). The
ratio is taken per token or per sequence (the product of its tokens' ratios), then either
truncated into `[clip_min, clip_max]` or set to zero outside it (masked).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

SAMPLING_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""`{level}_{bounding}`: level token or sequence; bounding truncate (clamp) or mask (zero)."""


def sampling_correction(
    trainer_logps: Tensor,
    sampling_logps: Tensor,
    mask: Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights `pi_trainer / pi_sampler` for the surrogate loss, and their statistics.

    Args:
        trainer_logps: `(batch, seq)` log-probs of the sampled tokens under the trainer's policy
            before the update (no grad).
        sampling_logps: `(batch, seq)` the engine's log-probs of the same tokens; NaN where the
            engine gave none (ratio 1 there).
        mask: `(batch, seq)`, 1 on completion tokens.
        mode: one of `SAMPLING_CORRECTION_MODES`.
        clip_min, clip_max: bounds of the ratio; None leaves that side open.

    Returns:
        weights: `(batch, seq)` for token modes, `(batch, 1)` for sequence modes; no grad.
        metrics: 0-dim tensors `sampling/importance_sampling_ratio/{min,mean,max}` (over tokens,
            or sequences, after bounding) and `sampling/sampling_logp_difference/{mean,max}`
            (absolute per-token gap).
    """
    if mode not in SAMPLING_CORRECTION_MODES:
        raise ValueError(
            f"Unknown vllm_importance_sampling_mode {mode!r}; known: {', '.join(SAMPLING_CORRECTION_MODES)}"
        )
    if clip_min is not None and clip_max is not None and clip_min > clip_max:
        raise ValueError(f"clip_min ({clip_min}) must not exceed clip_max ({clip_max})")
    with torch.no_grad():
        valid = mask.bool() & ~sampling_logps.isnan()
        gap = torch.where(valid, trainer_logps.float() - sampling_logps.float(), 0.0)  # (batch, seq)
        sequence_level = mode.startswith("sequence")
        log_ratio = gap.sum(-1, keepdim=True) if sequence_level else gap
        ratio = log_ratio.exp()
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        if mode.endswith("truncate"):
            weights = ratio.clamp(min=low, max=high)
        else:
            weights = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
        counted = torch.ones_like(weights, dtype=torch.bool) if sequence_level else mask.bool()
        metrics = {
            "sampling/importance_sampling_ratio/min": _reduce(weights, counted, torch.amin),
            "sampling/importance_sampling_ratio/mean": _reduce(weights, counted, torch.mean),
            "sampling/importance_sampling_ratio/max": _reduce(weights, counted, torch.amax),
            **_gap_metrics(gap.abs(), valid),
        }
    return weights, metrics


def exact_draw_weights(
    trainer_logps: Tensor, sampling_logps: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weights that keep a completion in the loss only when the engine's log-prob of every one of
    its tokens equals the trainer's bit for bit (an engine on the trainer's batch-invariant
    kernels draws from the trainer's own distribution; a difference means it did not).

    Args: as `sampling_correction`'s; a NaN (no engine log-prob) counts as a difference.

    Returns:
        weights: `(batch, 1)` 1.0 or 0.0, no grad.
        metrics: `on_policy/unverified_fraction` (of the completions with loss tokens, those left
            out) and the gap's `sampling/sampling_logp_difference/{mean,max}`.
    """
    with torch.no_grad():
        tokens = mask.bool()
        differs = tokens & (trainer_logps.float() != sampling_logps.float())  # NaN differs too
        kept = ~differs.any(-1, keepdim=True)
        scored = tokens.any(-1, keepdim=True)
        metrics = {
            "on_policy/unverified_fraction": _reduce((~kept).float(), scored, torch.mean),
            **sampling_logp_gap(trainer_logps, sampling_logps, mask),
        }
    return kept.float(), metrics


def sampling_logp_gap(trainer_logps: Tensor, sampling_logps: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the engine's log-probs of the sampled tokens are from the trainer's, uncorrected:
    `sampling/sampling_logp_difference/{mean,max}` of |trainer - sampler| over the tokens of
    `mask` where the engine gave a log-prob (not NaN)."""
    with torch.no_grad():
        valid = mask.bool() & ~sampling_logps.isnan()
        return _gap_metrics((trainer_logps.float() - sampling_logps.float()).abs(), valid)


def _gap_metrics(gaps: Tensor, valid: Tensor) -> dict[str, Tensor]:
    return {
        "sampling/sampling_logp_difference/mean": _reduce(gaps, valid, torch.mean),
        "sampling/sampling_logp_difference/max": _reduce(gaps, valid, torch.amax),
    }


def _reduce(values: Tensor, where: Tensor, reduce) -> Tensor:
    """`reduce` (torch.mean, amin or amax) over the elements of `values` that `where` keeps, 0
    when it keeps none; on the device, with no wait for it (boolean indexing would wait)."""
    if not values.numel():
        return values.new_zeros(())
    if reduce is torch.mean:
        return torch.where(where, values, 0.0).sum() / where.sum().clamp(min=1)
    fill = math.inf if reduce is torch.amin else -math.inf
    return torch.where(where.any(), reduce(torch.where(where, values, fill)), 0.0)
