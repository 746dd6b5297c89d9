"""The policy loss of the GRPO family: a per-token surrogate, a KL penalty, and a reduction.

A `loss_type` names a registered surrogate (`surrogates.py`: clipped, CISPO, SAPO, VESPO) and a
reduction that turns masked per-token losses into a scalar (`loss_types.py`). The math matches TRL
1.16's `GRPOTrainer`; where that departs from the papers:

- GRPO (`loss_type="grpo"`): per-sequence token mean, then mean over sequences, as in the paper.
  The KL penalty is Schulman's k3 estimator added to every token's loss; it is added after the
  importance-sampling correction weights and is never clipped.
- KL bias correction (on by default, as in TRL 1.16): the k3 term is multiplied by the
  (differentiable, unclipped) importance ratio `pi / pi_old`, following DeepSeek-V3.2. The
  samples come from `pi_old`, so this makes the KL gradient the unbiased reverse-KL gradient; it
  changes the gradient even on-policy, where the ratio's value is 1. The GRPO paper has plain k3.
- BNPO (`"bnpo"`): one token mean over the micro-batch.
- Dr. GRPO (`"dr_grpo"`): token sum over the constant `num_sequences * max_completion_length`,
  which removes the length bias of the per-sequence mean. The paper also drops the reward std;
  that is `scale_rewards="none"` in `advantages.py`, not part of the loss.
- DAPO (`"dapo"`, the default): token sum over the number of completion tokens in the whole
  generation batch (`num_items_in_batch`), so micro-batches add up to the paper's token-level
  loss. `epsilon_high > epsilon_low` is DAPO's clip-higher. Dynamic sampling and the overlong
  filter live in `filters.py`; the overlong *reward shaping* is a reward function.
- CISPO (`"cispo"`) and VESPO (`"vespo"`) reduce as DAPO does; SAPO (`"sapo"`) as GRPO does.
- LUSPO (`"luspo"`): the clipped surrogate summed over each sequence's tokens, then averaged over
  sequences, so that at sequence level each sequence weighs by its length (meant for
  `importance_sampling_level="sequence"`).
- GSPO (`importance_sampling_level="sequence"`): `r = exp(mean_t log(pi / pi_old))` per sequence,
  with the gradient flowing through the mean (the paper's GSPO, not GSPO-token). The per-sequence
  loss is then reduced by `loss_type` like a per-token one: "grpo" gives the paper's mean over
  sequences, while "dapo" and "bnpo" weigh each sequence by its number of tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpoflow.algo import loss_types
from grpoflow.algo.kl import kl_estimate
from grpoflow.algo.loss_types import BatchTotals
from grpoflow.algo.registry import entry
from grpoflow.algo.surrogates import SurrogateInputs, masked_mean


def micro_batch_scale(
    loss_type: str,
    num_micro_batches: int,
    num_sequences: int | None = None,
    num_sequences_in_batch: int | None = None,
) -> float:
    """Factor by which to multiply a micro-batch's loss before accumulating gradients.

    With "dapo", "dr_grpo", "cispo" and "vespo" the caller passes the generation batch's totals
    (`num_items_in_batch`, `num_sequences_in_batch`) to every micro-batch, so the micro-batch
    losses already sum to the full-batch loss: the factor is 1. "grpo", "sapo" and "luspo" are
    means over the micro-batch's sequences: the factor is its share of the batch's sequences,
    `num_sequences / num_sequences_in_batch`, so that micro-batches of any sizes (token-budget
    ones) add up to the mean over the whole batch; without those counts, `1 / num_micro_batches`
    (the same for equal micro-batches). "bnpo" is a token mean over its micro-batch, which TRL
    defines per local batch: the factor is `1 / num_micro_batches`.

    Args:
        num_micro_batches: micro-batches of the generation batch, over every rank.
        num_sequences: completions in this micro-batch.
        num_sequences_in_batch: completions in the generation batch, over every rank.
    """
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}.")
    accumulation = loss_types.loss_type(loss_type).reduction.accumulation
    if accumulation == "sum":
        return 1.0
    if accumulation == "sequences" and num_sequences is not None and num_sequences_in_batch:
        return num_sequences / num_sequences_in_batch
    return 1.0 / num_micro_batches


def _token_log_weights(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return log_ratio


def _sequence_log_weights(log_ratio: Tensor, mask: Tensor) -> Tensor:
    mean = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return mean.unsqueeze(-1)


IMPORTANCE_SAMPLING_LEVELS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token": _token_log_weights,
    "sequence": _sequence_log_weights,
}
"""`(log_ratio (batch, seq), mask (batch, seq)) -> log importance weights (batch, seq) or (batch, 1)`."""


@dataclass(frozen=True, slots=True)
class LossSettings:
    """What `policy_loss` computes: the loss type with its own settings, the importance-sampling
    level and the KL penalty."""

    loss_type: str = "dapo"
    """A key of `LOSS_TYPES`."""
    surrogate_settings: object | None = None
    """An instance of the loss type's `settings` dataclass; None: that dataclass's defaults."""
    importance_sampling_level: str = "token"
    """A key of `IMPORTANCE_SAMPLING_LEVELS` ("sequence" is GSPO)."""
    beta: float = 0.0
    """Weight of the per-token KL penalty."""
    kl_estimator: str = "k3"
    """A key of `kl.KL_ESTIMATORS` for the per-token KL penalty."""
    kl_bias_correction: bool = True
    """Multiply the per-token KL by the importance ratio (TRL's `use_bias_correction_kl`); False
    gives the GRPO paper's plain k3 penalty."""

    def __post_init__(self) -> None:
        settings_class = loss_types.loss_type(self.loss_type).settings
        if self.surrogate_settings is not None and type(self.surrogate_settings) is not settings_class:
            raise TypeError(
                f"loss_type {self.loss_type!r} takes {settings_class.__name__}, got "
                f"{type(self.surrogate_settings).__name__}."
            )
        entry(IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_level", self.importance_sampling_level)

    def surrogate(self) -> object:
        """The loss type's settings: those given, or its dataclass's defaults."""
        settings_class = loss_types.loss_type(self.loss_type).settings
        return settings_class() if self.surrogate_settings is None else self.surrogate_settings


def policy_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    settings: LossSettings | None = None,
    totals: BatchTotals | None = None,
    *,
    ref_logps: Tensor | None = None,
    is_weights: Tensor | None = None,
    loss_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token surrogate plus an optional KL penalty, reduced as `settings.loss_type` says.

    Args:
        logps: `(batch, seq)` log-probabilities of the completion tokens under the policy (with grad).
        old_logps: `(batch, seq)` the same under the policy that sampled them; None means
            on-policy (`logps.detach()`, ratio 1).
        advantages: `(batch,)`, or `(batch, seq)` per token.
        mask: `(batch, seq)`, 1 on completion tokens that count in the loss.
        settings: the loss type and its settings, the importance-sampling level and the KL
            penalty; None: `LossSettings()` (dapo with TRL's defaults, no KL).
        totals: the whole generation batch's counts ("dapo", "cispo", "vespo" divide by its
            completion tokens, "dr_grpo" by its completions times the generation limit); None:
            this batch's own (`max_completion_length` is then missing, which "dr_grpo" needs).
        ref_logps: `(batch, seq)` reference log-probabilities; required when `beta != 0`.
        is_weights: `(batch, seq)` or `(batch, 1)` importance-sampling correction weights (e.g.
            trainer-vs-sampler mismatch); they multiply the surrogate, not the KL term.
        loss_weights: `(batch, seq)` or `(batch, 1)` 0/1 weights of the surrogate (the off-policy
            mask, the high-entropy token mask); the KL term and the normaliser keep every token.

    Returns:
        loss: 0-dim tensor with grad.
        metrics: 0-dim detached tensors: the surrogate's (`clip_ratio/{low,high,region}_mean`
            for the clipped types, token means or sequence means at sequence level;
            `cispo_clip_ratio`; `vespo/phi_seq_mean`) and, when `beta != 0`, `kl` (token mean of
            the KL term as it enters the loss, before `beta`).
    """
    settings = LossSettings() if settings is None else settings
    kind = loss_types.loss_type(settings.loss_type)
    if settings.beta != 0.0 and ref_logps is None:
        raise ValueError("beta != 0 adds a KL penalty to the reference model; pass ref_logps.")
    mask = mask.to(logps.dtype)
    old_logps = logps.detach() if old_logps is None else old_logps
    advantages = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # (batch, 1 or seq)

    log_ratio = logps - old_logps
    ratio = torch.exp(IMPORTANCE_SAMPLING_LEVELS[settings.importance_sampling_level](log_ratio, mask))
    inputs = SurrogateInputs(logps, log_ratio, ratio, advantages, mask, is_weights)
    per_token_loss, metrics = kind.surrogate(inputs, settings.surrogate())  # (batch, seq) or (batch, 1)
    if loss_weights is not None:
        per_token_loss = per_token_loss * loss_weights
    if is_weights is not None and kind.weighs_sampler_mismatch:
        per_token_loss = per_token_loss * is_weights
    if settings.beta != 0.0:
        kl = kl_estimate(logps, ref_logps, settings.kl_estimator) * (
            ratio if settings.kl_bias_correction else 1.0
        )  # (batch, seq)
        per_token_loss = per_token_loss + settings.beta * kl
        metrics["kl"] = masked_mean(kl, mask)

    loss = kind.reduction.reduce(per_token_loss, mask, BatchTotals() if totals is None else totals)
    return loss, {name: value.detach() for name, value in metrics.items()}
