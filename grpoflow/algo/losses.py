"""The policy loss of the GRPO family: a per-token surrogate, a KL penalty, and a reduction.

A `loss_type` names a surrogate (`surrogates.py`: clipped, CISPO, SAPO, VESPO) and a reduction that
turns masked per-token losses into a scalar. The math matches TRL 1.16's `GRPOTrainer`; where that
departs from the papers:

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
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from grpoflow.algo.kl import kl_estimate
from grpoflow.algo.surrogates import (
    Surrogate,
    SurrogateInputs,
    SurrogateSettings,
    cispo,
    clipped,
    masked_mean,
    sapo,
    vespo,
)


def _reduce_grpo(per_token_loss: Tensor, mask: Tensor, **_) -> Tensor:
    per_sequence = (per_token_loss * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return per_sequence.mean()


def _reduce_bnpo(per_token_loss: Tensor, mask: Tensor, **_) -> Tensor:
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def _reduce_dr_grpo(
    per_token_loss: Tensor,
    mask: Tensor,
    *,
    max_completion_length: int | None,
    num_sequences_in_batch: int | None,
    **_,
) -> Tensor:
    if max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' divides by max_completion_length; pass it to policy_loss.")
    num_sequences = mask.size(0) if num_sequences_in_batch is None else num_sequences_in_batch
    return (per_token_loss * mask).sum() / (num_sequences * max_completion_length)


def _reduce_dapo(
    per_token_loss: Tensor, mask: Tensor, *, num_items_in_batch: Tensor | int | None, **_
) -> Tensor:
    num_items = mask.sum() if num_items_in_batch is None else num_items_in_batch
    num_items = torch.as_tensor(num_items, dtype=per_token_loss.dtype, device=per_token_loss.device)
    return (per_token_loss * mask).sum() / num_items.clamp(min=1.0)


def _reduce_luspo(per_token_loss: Tensor, mask: Tensor, **_) -> Tensor:
    return (per_token_loss * mask).sum(dim=-1).mean()


@dataclass(frozen=True, slots=True)
class LossReduction:
    """How one loss type turns masked per-token losses into a scalar."""

    reduce: Callable[..., Tensor]
    """`(per_token_loss (batch, seq), mask (batch, seq), **batch totals) -> 0-dim loss`."""
    accumulation: Literal["sum", "sequences", "micro_batches"]
    """How micro-batch losses add up to the batch's (`micro_batch_scale`): "sum" when the divisor
    already counts the whole generation batch; "sequences" for a mean over the micro-batch's
    sequences, weighted by its share of the batch's sequences; "micro_batches" for a mean over
    the micro-batch's tokens, averaged over micro-batches (TRL's local-batch normalisation)."""


LOSS_REDUCTIONS: dict[str, LossReduction] = {
    "grpo": LossReduction(_reduce_grpo, accumulation="sequences"),
    "bnpo": LossReduction(_reduce_bnpo, accumulation="micro_batches"),
    "dr_grpo": LossReduction(_reduce_dr_grpo, accumulation="sum"),
    "dapo": LossReduction(_reduce_dapo, accumulation="sum"),
    "luspo": LossReduction(_reduce_luspo, accumulation="sequences"),
}
"""Loss reductions by the name of the loss type that introduced them."""


@dataclass(frozen=True, slots=True)
class LossType:
    """A per-token surrogate and the reduction of its per-token losses."""

    surrogate: Surrogate
    reduction: LossReduction
    weighs_sampler_mismatch: bool = True
    """False when the surrogate folds the sampler-mismatch weights in itself (VESPO)."""


LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(clipped, LOSS_REDUCTIONS["grpo"]),
    "bnpo": LossType(clipped, LOSS_REDUCTIONS["bnpo"]),
    "dr_grpo": LossType(clipped, LOSS_REDUCTIONS["dr_grpo"]),
    "dapo": LossType(clipped, LOSS_REDUCTIONS["dapo"]),
    "luspo": LossType(clipped, LOSS_REDUCTIONS["luspo"]),
    "cispo": LossType(cispo, LOSS_REDUCTIONS["dapo"]),
    "sapo": LossType(sapo, LOSS_REDUCTIONS["grpo"]),
    "vespo": LossType(vespo, LOSS_REDUCTIONS["dapo"], weighs_sampler_mismatch=False),
}
"""Loss types by `loss_type` name; a plugin adds one by adding an entry."""


def _loss_type(loss_type: str) -> LossType:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; known: {sorted(LOSS_TYPES)}.")
    return LOSS_TYPES[loss_type]


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
    accumulation = _loss_type(loss_type).reduction.accumulation
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


def policy_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logps: Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: Tensor | int | None = None,
    num_sequences_in_batch: int | None = None,
    is_weights: Tensor | None = None,
    kl_bias_correction: bool = True,
    surrogate_settings: SurrogateSettings | None = None,
    kl_estimator: str = "k3",
    loss_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token surrogate plus an optional KL penalty, reduced as `loss_type` says.

    Args:
        logps: `(batch, seq)` log-probabilities of the completion tokens under the policy (with grad).
        old_logps: `(batch, seq)` the same under the policy that sampled them; None means
            on-policy (`logps.detach()`, ratio 1).
        advantages: `(batch,)`, or `(batch, seq)` per token.
        mask: `(batch, seq)`, 1 on completion tokens that count in the loss.
        ref_logps: `(batch, seq)` reference log-probabilities; required when `beta != 0`.
        beta: weight of the per-token KL penalty.
        epsilon_low, epsilon_high: clip range `[1 - epsilon_low, 1 + epsilon_high]` (CISPO caps
            its weight at `epsilon_high`).
        delta: if set, the ratio is also capped at `delta` (two-sided clipping).
        loss_type: a key of `LOSS_TYPES`.
        importance_sampling_level: a key of `IMPORTANCE_SAMPLING_LEVELS` ("sequence" is GSPO).
        max_completion_length: the generation limit; required by "dr_grpo".
        num_items_in_batch: completion tokens in the whole generation batch ("dapo", "cispo",
            "vespo"); defaults to `mask.sum()`.
        num_sequences_in_batch: completions in the whole generation batch ("dr_grpo");
            defaults to `batch`.
        is_weights: `(batch, seq)` or `(batch, 1)` importance-sampling correction weights (e.g.
            trainer-vs-sampler mismatch); they multiply the surrogate, not the KL term.
        kl_bias_correction: multiply the per-token KL by the importance ratio (TRL's
            `use_bias_correction_kl`); False gives the GRPO paper's plain k3 penalty.
        surrogate_settings: SAPO temperatures and VESPO shape parameters; the epsilons and
            `delta` given here take precedence over its own.
        kl_estimator: a key of `kl.KL_ESTIMATORS` for the per-token KL penalty.
        loss_weights: `(batch, seq)` or `(batch, 1)` 0/1 weights of the surrogate (the off-policy
            mask, the high-entropy token mask); the KL term and the normaliser keep every token.

    Returns:
        loss: 0-dim tensor with grad.
        metrics: 0-dim detached tensors: the surrogate's (`clip_ratio/{low,high,region}_mean`
            for the clipped types, token means or sequence means at sequence level;
            `cispo_clip_ratio`; `vespo/phi_seq_mean`) and, when `beta != 0`, `kl` (token mean of
            the KL term as it enters the loss, before `beta`).
    """
    kind = _loss_type(loss_type)
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"Unknown importance_sampling_level {importance_sampling_level!r}; known: "
            f"{sorted(IMPORTANCE_SAMPLING_LEVELS)}."
        )
    if beta != 0.0 and ref_logps is None:
        raise ValueError("beta != 0 adds a KL penalty to the reference model; pass ref_logps.")
    settings = replace(
        surrogate_settings or SurrogateSettings(),
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        delta=delta,
    )
    mask = mask.to(logps.dtype)
    old_logps = logps.detach() if old_logps is None else old_logps
    advantages = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # (batch, 1 or seq)

    log_ratio = logps - old_logps
    ratio = torch.exp(IMPORTANCE_SAMPLING_LEVELS[importance_sampling_level](log_ratio, mask))
    inputs = SurrogateInputs(logps, log_ratio, ratio, advantages, mask, is_weights)
    per_token_loss, metrics = kind.surrogate(inputs, settings)  # (batch, seq) or (batch, 1)
    if loss_weights is not None:
        per_token_loss = per_token_loss * loss_weights
    if is_weights is not None and kind.weighs_sampler_mismatch:
        per_token_loss = per_token_loss * is_weights
    if beta != 0.0:
        kl = kl_estimate(logps, ref_logps, kl_estimator) * (
            ratio if kl_bias_correction else 1.0
        )  # (batch, seq)
        per_token_loss = per_token_loss + beta * kl
        metrics["kl"] = masked_mean(kl, mask)

    loss = kind.reduction.reduce(
        per_token_loss,
        mask,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
        num_sequences_in_batch=num_sequences_in_batch,
    )
    return loss, {name: value.detach() for name, value in metrics.items()}
