"""Per-token policy objectives, one per family of `loss_type`, as TRL 1.16 defines them.

Each surrogate turns importance ratios and advantages into a per-token loss; `losses.py` then adds
the KL penalty and reduces. Where they depart from their papers:

- Clipped (GRPO, DAPO, Dr. GRPO, BNPO, LUSPO): PPO's `-min(r * A, clip(r, 1 - eps_low,
  1 + eps_high) * A)`; `delta` (INTELLECT-2) also caps the unclipped `r`.
- CISPO (MiniMax-M1): `-sg(min(r, epsilon_high)) * A * log pi`. The weight is capped at
  `epsilon_high` itself, not `1 + epsilon_high` (ScaleRL's epsilon_max; 5.0 is its suggestion), and
  no lower bound is applied, as in TRL.
- SAPO (Soft Adaptive Policy Optimization): `-sigmoid(tau * (r - 1)) * 4 / tau * A`, with
  `tau = sapo_temperature_pos` where `A > 0` and `sapo_temperature_neg` elsewhere. Its gradient
  at `r = 1` equals the unclipped surrogate's and fades smoothly as `r` leaves 1.
- VESPO: `-sg(phi(w)) * A * log pi` with `w` the sequence's importance weight (the product of its
  token ratios, times the sampler-mismatch weights if any) and `phi(w) = exp(lambda) * w^k *
  exp(-lambda * w)`, a Gamma-shaped weight with `phi(1) = 1`; `(k, lambda)` depend on the sign of
  `A`. Log-ratios are clamped to [-20, 20] per token and `log w` to [log 1e-8, 20], as TRL does.
  Because `w` already holds the sampler-mismatch weights, the loss does not multiply by them again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class SurrogateSettings:
    """The hyperparameters of every surrogate (TRL's GRPOConfig names and defaults)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


@dataclass(frozen=True, slots=True)
class SurrogateInputs:
    """What a surrogate reads, shapes in brackets."""

    logps: Tensor
    """(batch, seq) policy log-probs of the sampled tokens, with grad."""
    log_ratio: Tensor
    """(batch, seq) `logps - old_logps` per token."""
    ratio: Tensor
    """(batch, seq) or (batch, 1): the importance ratio at the chosen importance-sampling level."""
    advantages: Tensor
    """(batch, 1) or (batch, seq)."""
    mask: Tensor
    """(batch, seq) float, 1 on tokens that count."""
    is_weights: Tensor | None
    """(batch, seq) or (batch, 1) sampler-mismatch weights, or None."""


def _pick(condition: Tensor, if_true: float, if_false: float, like: Tensor) -> Tensor:
    """`torch.where` on two numbers, in `like`'s dtype (a bare float would be float32)."""
    return torch.where(condition, like.new_tensor(if_true), like.new_tensor(if_false))


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over unmasked tokens; over sequences when `values` is per sequence `(batch, 1)`."""
    if values.size(-1) == 1 and mask.size(-1) != 1:
        return values.mean()
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def clipped(inputs: SurrogateInputs, settings: SurrogateSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate; metrics `clip_ratio/{low,high,region}_mean`."""
    ratio, advantages = inputs.ratio, inputs.advantages
    clipped_ratio = torch.clamp(ratio, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    if settings.delta is not None:
        ratio = torch.clamp(ratio, max=settings.delta)
    per_token_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    is_low = (ratio < 1 - settings.epsilon_low) & (advantages < 0)
    is_high = (ratio > 1 + settings.epsilon_high) & (advantages > 0)
    metrics = {
        "clip_ratio/low_mean": masked_mean(is_low.float(), inputs.mask),
        "clip_ratio/high_mean": masked_mean(is_high.float(), inputs.mask),
        "clip_ratio/region_mean": masked_mean((is_low | is_high).float(), inputs.mask),
    }
    return per_token_loss, metrics


def cispo(inputs: SurrogateInputs, settings: SurrogateSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO's clipped, detached importance weight times the policy gradient; metric
    `cispo_clip_ratio` (tokens with `A > 0` whose ratio exceeds `epsilon_high`)."""
    weight = torch.clamp(inputs.ratio, max=settings.epsilon_high).detach()
    per_token_loss = -weight * inputs.advantages * inputs.logps
    is_clipped = (inputs.ratio > settings.epsilon_high) & (inputs.advantages > 0)
    return per_token_loss, {"cispo_clip_ratio": masked_mean(is_clipped.float(), inputs.mask)}


def sapo(inputs: SurrogateInputs, settings: SurrogateSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO's sigmoid-gated surrogate; no metrics."""
    positive = inputs.advantages > 0
    temperature = _pick(positive, settings.sapo_temperature_pos, settings.sapo_temperature_neg, inputs.ratio)
    gate = torch.sigmoid(temperature * (inputs.ratio - 1)) * 4 / temperature
    return -gate * inputs.advantages, {}


_LOG_WEIGHT_FLOOR = math.log(1e-8)


@torch.no_grad()
def vespo_weights(inputs: SurrogateInputs, settings: SurrogateSettings) -> Tensor:
    """`phi(w)` per sequence, `(batch, 1)`, without grad (see the module docstring)."""
    log_ratio = torch.clamp(inputs.log_ratio, -20.0, 20.0)
    log_weight = (log_ratio * inputs.mask).sum(dim=-1, keepdim=True)  # (batch, 1)
    if inputs.is_weights is not None:
        log_is = torch.clamp(torch.log(inputs.is_weights), _LOG_WEIGHT_FLOOR, 20.0)
        log_weight = log_weight + log_is.sum(dim=-1, keepdim=True)
    log_weight = torch.clamp(log_weight, _LOG_WEIGHT_FLOOR, 20.0)
    non_negative = inputs.advantages >= 0
    k = _pick(non_negative, settings.vespo_k_pos, settings.vespo_k_neg, log_weight)
    lam = _pick(non_negative, settings.vespo_lambda_pos, settings.vespo_lambda_neg, log_weight).clamp(
        min=1e-4
    )
    log_phi = lam + k * log_weight - lam * torch.exp(log_weight)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo(inputs: SurrogateInputs, settings: SurrogateSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """VESPO's Gamma-weighted policy gradient; metric `vespo/phi_seq_mean`."""
    phi = vespo_weights(inputs, settings)
    per_token_loss = -phi * inputs.advantages * inputs.logps
    return per_token_loss, {"vespo/phi_seq_mean": masked_mean(phi, inputs.mask)}


Surrogate = Callable[[SurrogateInputs, SurrogateSettings], tuple[Tensor, dict[str, Tensor]]]
"""`(inputs, settings) -> (per-token loss (batch, seq) or (batch, 1), metrics)`."""
