"""Per-token policy objectives, one per family of `loss_type`, as TRL 1.16 defines them, each
registered as the loss types it makes (`loss_types.register_loss`) with its settings' dataclass.

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
from dataclasses import dataclass

import torch
from torch import Tensor

from grpoflow.algo.loss_types import register_loss


@dataclass(frozen=True, slots=True)
class ClipSettings:
    """The clip range of the clipped surrogates and CISPO (TRL's names and defaults)."""

    epsilon: float = 0.2
    """Lower clip range of the importance ratio."""
    epsilon_high: float | None = None
    """Upper clip range (DAPO clip-higher); defaults to epsilon.

    CISPO caps its weight at this value itself, not at 1 + epsilon_high."""
    delta: float | None = None
    """Upper clamp on the unclipped ratio (two-sided clipping); off when None."""

    @property
    def upper(self) -> float:
        """`epsilon_high`, or `epsilon` when unset."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True, slots=True)
class SapoSettings:
    """The gate temperatures of SAPO (TRL's names and defaults)."""

    sapo_temperature_pos: float = 1.0
    """SAPO gate temperature for tokens with positive advantage."""
    sapo_temperature_neg: float = 1.05
    """SAPO gate temperature for tokens with zero or negative advantage."""


@dataclass(frozen=True, slots=True)
class VespoSettings:
    """The shape of VESPO's Gamma weight (TRL's names and defaults)."""

    vespo_k_pos: float = 2.0
    """VESPO power exponent for non-negative advantages (down-weights ratios below 1)."""
    vespo_lambda_pos: float = 3.0
    """VESPO decay for non-negative advantages (down-weights ratios above 1)."""
    vespo_k_neg: float = 3.0
    """VESPO power exponent for negative advantages."""
    vespo_lambda_neg: float = 2.0
    """VESPO decay for negative advantages."""


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


def clipped(inputs: SurrogateInputs, settings: ClipSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate; metrics `clip_ratio/{low,high,region}_mean`."""
    ratio, advantages = inputs.ratio, inputs.advantages
    clipped_ratio = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.upper)
    if settings.delta is not None:
        ratio = torch.clamp(ratio, max=settings.delta)
    per_token_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    is_low = (ratio < 1 - settings.epsilon) & (advantages < 0)
    is_high = (ratio > 1 + settings.upper) & (advantages > 0)
    metrics = {
        "clip_ratio/low_mean": masked_mean(is_low.float(), inputs.mask),
        "clip_ratio/high_mean": masked_mean(is_high.float(), inputs.mask),
        "clip_ratio/region_mean": masked_mean((is_low | is_high).float(), inputs.mask),
    }
    return per_token_loss, metrics


# Registered in the order options and errors list the loss types.
for _name in ("grpo", "bnpo", "dr_grpo", "dapo"):
    register_loss(_name, reduction=_name, settings=ClipSettings)(clipped)


@register_loss("cispo", reduction="dapo", settings=ClipSettings)
def cispo(inputs: SurrogateInputs, settings: ClipSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO's clipped, detached importance weight times the policy gradient; metric
    `cispo_clip_ratio` (tokens with `A > 0` whose ratio exceeds `epsilon_high`)."""
    weight = torch.clamp(inputs.ratio, max=settings.upper).detach()
    per_token_loss = -weight * inputs.advantages * inputs.logps
    is_clipped = (inputs.ratio > settings.upper) & (inputs.advantages > 0)
    return per_token_loss, {"cispo_clip_ratio": masked_mean(is_clipped.float(), inputs.mask)}


@register_loss("sapo", reduction="grpo", settings=SapoSettings)
def sapo(inputs: SurrogateInputs, settings: SapoSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO's sigmoid-gated surrogate; no metrics."""
    positive = inputs.advantages > 0
    temperature = _pick(positive, settings.sapo_temperature_pos, settings.sapo_temperature_neg, inputs.ratio)
    gate = torch.sigmoid(temperature * (inputs.ratio - 1)) * 4 / temperature
    return -gate * inputs.advantages, {}


register_loss("luspo", reduction="luspo", settings=ClipSettings)(clipped)

_LOG_WEIGHT_FLOOR = math.log(1e-8)


@torch.no_grad()
def vespo_weights(inputs: SurrogateInputs, settings: VespoSettings) -> Tensor:
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


@register_loss("vespo", reduction="dapo", settings=VespoSettings, weighs_sampler_mismatch=False)
def vespo(inputs: SurrogateInputs, settings: VespoSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """VESPO's Gamma-weighted policy gradient; metric `vespo/phi_seq_mean`."""
    phi = vespo_weights(inputs, settings)
    per_token_loss = -phi * inputs.advantages * inputs.logps
    return per_token_loss, {"vespo/phi_seq_mean": masked_mean(phi, inputs.mask)}
