"""The policy-update phase: old and reference log-probs, micro-batched loss, optimizer steps.

Over several ranks, each runs its own micro-batches and the gradients are summed over ranks before
clipping (by `all_reduce_gradients` for a replicated model, by FSDP's reduce-scatter for a sharded
one, whose forward passes run inside its root: `grpoflow.policy.placement`); the models come with
their `Placement`, through which every forward pass runs. The loss is normalised by the global
batch's totals (dapo's completion tokens, dr_grpo's completions; grpo and bnpo average over
the micro-batches of every rank), so the summed gradient equals one process's on the whole batch
split into the same micro-batches.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import torch

from grpoflow.algo import (
    ADV_ESTIMATORS,
    SurrogateSettings,
    micro_batch_scale,
    policy_loss,
    sampling_correction,
    sampling_logp_gap,
    sequence_kl,
    sequence_logprobs,
)
from grpoflow.algo.estimators import AdvantageEstimator
from grpoflow.imports import load_object
from grpoflow.options import require
from grpoflow.policy.placement import Placement, clip_gradients
from grpoflow.run.distributed import DistributedContext
from grpoflow.run.rollout import RolloutBatch

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """The GRPO-family objective."""

    beta: float = 0.0
    """KL coefficient; 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    """Per-token KL estimator (`algo.KL_ESTIMATORS`); low_var_kl is verl's clipped k3."""
    kl_in_reward: bool = False
    """Subtract beta x the completion's summed KL from its reward before advantages, instead of
    adding the KL to the loss."""
    epsilon: float = 0.2
    """Lower clip range of the importance ratio."""
    epsilon_high: float | None = None
    """Upper clip range (DAPO clip-higher); defaults to epsilon."""
    delta: float | None = None
    """Upper clamp on the unclipped ratio (two-sided clipping); off when None."""
    num_iterations: int = 1
    """Policy updates per generation batch."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
    """Per-token surrogate and reduction (`algo.LOSS_TYPES`)."""
    sapo_temperature_pos: float = 1.0
    """SAPO gate temperature for tokens with positive advantage."""
    sapo_temperature_neg: float = 1.05
    """SAPO gate temperature for tokens with zero or negative advantage."""
    vespo_k_pos: float = 2.0
    """VESPO power exponent for non-negative advantages (down-weights ratios below 1)."""
    vespo_lambda_pos: float = 3.0
    """VESPO decay for non-negative advantages (down-weights ratios above 1)."""
    vespo_k_neg: float = 3.0
    """VESPO power exponent for negative advantages."""
    vespo_lambda_neg: float = 2.0
    """VESPO decay for negative advantages."""
    adv_estimator: str = "grpo"
    """How rewards become advantages: grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline
    (`algo.ADV_ESTIMATORS`), or an estimator's import path (`pkg.module:fn`, `file.py:fn`)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the std of the group, of the batch, or not at all (adv_estimator grpo)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Ratio per token (GRPO) or per sequence (GSPO)."""
    mask_truncated_completions: bool = False
    """Truncated completions carry no loss (DAPO overlong filtering; alias overlong_filter)."""
    dynamic_sample: bool = False
    """Drop groups whose rewards have zero spread and sample more prompts (DAPO)."""
    max_resample_times: int = 3
    """Most extra sampling rounds per step under dynamic_sample."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk when computing log-probs, bounding the fp32 logits in memory."""

    def __post_init__(self) -> None:
        require(self.beta >= 0, "beta", ">= 0", self.beta)
        for name in ("epsilon", "epsilon_high", "num_iterations", "logprob_chunk_size"):
            value = getattr(self, name)
            require(value is None or value > 0, name, "> 0", value)
        require(
            self.delta is None or self.delta > 1, "delta", "> 1 (an upper bound on the ratio)", self.delta
        )
        require(self.max_resample_times >= 0, "max_resample_times", ">= 0", self.max_resample_times)
        require(
            not self.kl_in_reward or self.beta > 0,
            "beta",
            "> 0 under kl_in_reward",
            self.beta,
            "set beta (the KL coefficient) or turn kl_in_reward off",
        )
        require(
            self.adv_estimator in ADV_ESTIMATORS or ":" in self.adv_estimator,
            "adv_estimator",
            f"one of {', '.join(ADV_ESTIMATORS)} or an import path 'pkg.module:function'",
            self.adv_estimator,
        )
        if self.adv_estimator != "grpo" and self.scale_rewards != "group":
            logger.warning(
                "scale_rewards=%s is ignored: it applies to adv_estimator grpo", self.scale_rewards
            )
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            require(getattr(self, name) > 0, name, "> 0 (it divides the gate)", getattr(self, name))
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            require(getattr(self, name) >= 0, name, ">= 0", getattr(self, name))

    def advantage_estimator(self) -> AdvantageEstimator:
        """The estimator `adv_estimator` names, imported when it is an import path."""
        if self.adv_estimator in ADV_ESTIMATORS:
            return ADV_ESTIMATORS[self.adv_estimator]
        estimator = load_object(self.adv_estimator, "adv_estimator")
        require(callable(estimator), "adv_estimator", "a function's import path", self.adv_estimator)
        return estimator

    def surrogate_settings(self) -> SurrogateSettings:
        """The loss's hyperparameters as `algo.policy_loss` takes them."""
        return SurrogateSettings(
            epsilon_low=self.epsilon,
            epsilon_high=self.epsilon_high or self.epsilon,
            delta=self.delta,
            **{name: getattr(self, name) for name in _SURROGATE_OPTIONS},
        )


_SURROGATE_OPTIONS = (
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
)


@dataclass(kw_only=True, slots=True)
class ImportanceCorrection:
    """The importance-sampling correction of rollouts that the trainer's policy did not sample
    itself (TRL's names): the loss is weighted by pi_trainer / pi_sampler (`algo.sampling_correction`)."""

    vllm_importance_sampling_correction: bool | None = None
    """Reweight the loss by pi_trainer / pi_sampler; unset: on for engines that hold their own
    weights (vllm, vllm_server, async_generate), off for those that read the policy's (native,
    hf), whose kernels still round differently from the training forward (the gap is logged)."""
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "sequence_mask"
    """Ratio per token or per sequence; truncated into, or zeroed outside, the clip range."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """Upper bound of the importance ratio (None: open)."""
    vllm_importance_sampling_clip_min: float | None = None
    """Lower bound of the importance ratio (None: open)."""

    def __post_init__(self) -> None:
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        require(
            low is None or high is None or low <= high,
            "vllm_importance_sampling_clip_min",
            f"at most vllm_importance_sampling_clip_max ({high})",
            low,
        )


@dataclass(kw_only=True, slots=True)
class UpdateSettings:
    """What the update phase needs from the run's config."""

    algorithm: AlgorithmConfig
    micro_batch_size: int
    temperature: float
    max_completion_length: int
    max_grad_norm: float
    sampling_correction: ImportanceCorrection | None = None
    """Importance-sampling correction against the engine's log-probs; None trusts them."""
    sampling_logprobs: bool = True
    """The batch carries the engine's log-probs (their gap to the trainer's is logged)."""


def micro_batches(batch: RolloutBatch, size: int) -> list[RolloutBatch]:
    return [batch.rows(start, min(start + size, len(batch))) for start in range(0, len(batch), size)]


def batch_logprobs(
    placement: Placement, batch: RolloutBatch, settings: UpdateSettings, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (batch, completion_len) of the completion tokens under the placed model."""
    model = placement.module
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention_mask = (
        torch.cat([batch.prompt_mask, batch.completion_mask], dim=1) if batch.left_padded else None
    )
    return placement.sharded_forward(
        lambda: sequence_logprobs(
            model,
            input_ids,
            attention_mask,
            logits_to_keep=batch.completion_ids.shape[1],
            temperature=settings.temperature,
            chunk_size=settings.algorithm.logprob_chunk_size,
            compute_entropy=entropy,
        ),
    )


@torch.no_grad()
def frozen_logprobs(
    placement: Placement, parts: list[RolloutBatch], settings: UpdateSettings
) -> list[torch.Tensor]:
    """Log-probs of each micro-batch under the placed model without gradients (old policy,
    reference)."""
    model = placement.module
    was_training = model.training
    model.eval()
    try:
        return [batch_logprobs(placement, part, settings)[0] for part in parts]
    finally:
        model.train(was_training)


def reward_kl(
    placement: Placement, ref_placement: Placement, batch: RolloutBatch, settings: UpdateSettings
) -> torch.Tensor:
    """Each completion's KL to the reference, `(batch,)`: the sum over its loss tokens of the
    `kl_estimator` between the placed policy (before the update) and the reference model."""
    parts = micro_batches(batch, settings.micro_batch_size)
    logps = frozen_logprobs(placement, parts, settings)
    with ref_placement.in_use():
        ref = frozen_logprobs(ref_placement, parts, settings)
    estimator = settings.algorithm.kl_estimator
    return torch.cat(
        [
            sequence_kl(policy, reference, part.loss_mask, estimator)
            for policy, reference, part in zip(logps, ref, parts)
        ]
    )


def update_policy(
    placement: Placement,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batch: RolloutBatch,
    advantages: torch.Tensor,
    settings: UpdateSettings,
    ref_placement: Placement | None = None,
    distributed: DistributedContext | None = None,
) -> dict[str, float]:
    """Run `num_iterations` optimizer steps of the placed policy on one generation batch (with the
    placed reference model's log-probs, if any); return averaged metrics.

    advantages: (batch,). Tokens without a loss (inserted by an environment, or of completions
    masked out, e.g. truncated ones under overlong filtering) must have zeros in `batch.loss_mask`. Under `distributed`, `batch` is this rank's
    slice (every rank holds equally many rows) and the metrics are this rank's, to be averaged
    over ranks.
    """
    distributed = distributed or DistributedContext()
    model = placement.module
    algorithm = settings.algorithm
    parts = micro_batches(batch, settings.micro_batch_size)
    starts = [0]
    for part in parts:
        starts.append(starts[-1] + len(part))
    old = frozen_logprobs(placement, parts, settings) if algorithm.num_iterations > 1 else None
    ref = None
    if ref_placement is not None and not algorithm.kl_in_reward:
        with ref_placement.in_use():
            ref = frozen_logprobs(ref_placement, parts, settings)
    num_items = distributed.all_reduce(batch.loss_mask.sum()).clamp(min=1)
    num_micro_batches = len(parts) * distributed.world_size
    scale = micro_batch_scale(algorithm.loss_type, num_micro_batches)
    surrogate_settings = algorithm.surrogate_settings()
    # Metrics stay on the device until the end: a float() per micro-batch would stall the GPU.
    totals: dict[str, torch.Tensor | float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    is_weights: list[torch.Tensor | None] = [None] * len(parts)
    model.train()
    for iteration in range(algorithm.num_iterations):
        first_pass = iteration == 0
        for index, part in enumerate(parts):
            logps, entropy = batch_logprobs(placement, part, settings, entropy=True)
            correction_metrics = {}
            before_update = old[index] if old is not None else logps.detach()
            if settings.sampling_correction is not None and is_weights[index] is None:
                # Before the first optimizer step the policy's own log-probs are the old ones.
                is_weights[index], correction_metrics = _correction_weights(
                    before_update, part, settings.sampling_correction
                )
            elif settings.sampling_correction is None and settings.sampling_logprobs and first_pass:
                correction_metrics = sampling_logp_gap(before_update, part.sampling_logps, part.loss_mask)
            loss, metrics = policy_loss(
                logps,
                old[index] if old is not None else None,
                advantages[starts[index] : starts[index + 1]],
                part.loss_mask,
                ref_logps=ref[index] if ref is not None else None,
                beta=0.0 if algorithm.kl_in_reward else algorithm.beta,
                kl_estimator=algorithm.kl_estimator,
                epsilon_low=algorithm.epsilon,
                epsilon_high=algorithm.epsilon_high or algorithm.epsilon,
                delta=algorithm.delta,
                loss_type=algorithm.loss_type,
                importance_sampling_level=algorithm.importance_sampling_level,
                max_completion_length=settings.max_completion_length,
                num_items_in_batch=num_items,
                num_sequences_in_batch=len(batch) * distributed.world_size,
                is_weights=is_weights[index],
                surrogate_settings=surrogate_settings,
            )
            metrics.update(correction_metrics)
            (loss * scale).backward()
            # The whole batch's loss as this micro-batch estimates it; the mean over micro-batches
            # and ranks is the whole batch's loss.
            metrics["loss"] = loss.detach() * scale * num_micro_batches
            if entropy is not None:
                mask = part.loss_mask.to(entropy.dtype)
                metrics["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1)
            for name, value in metrics.items():
                _accumulate(totals, counts, name, value.detach())
        grad_norm = _optimizer_step(placement, optimizer, scheduler, settings, distributed)
        totals["grad_norm"] += grad_norm.detach()
        counts["grad_norm"] += 1
    totals["weights/nonfinite"] = nonfinite_weights(placement, distributed)
    counts["weights/nonfinite"] = 1
    return {name: float(totals[name]) / counts[name] for name in totals}


def _accumulate(totals: dict, counts: dict, name: str, value: torch.Tensor) -> None:
    """Add a micro-batch's metric: extremes (`.../min`, `.../max`) are kept as such, others are
    averaged."""
    if name.endswith(("/min", "/max")) and counts[name]:
        extreme = torch.minimum if name.endswith("/min") else torch.maximum
        totals[name] = extreme(totals[name], value)
        return
    totals[name] = totals[name] + value
    counts[name] += 1


def _correction_weights(
    trainer_logps: torch.Tensor, part: RolloutBatch, correction: ImportanceCorrection
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return sampling_correction(
        trainer_logps,
        part.sampling_logps,
        part.loss_mask,
        correction.vllm_importance_sampling_mode,
        correction.vllm_importance_sampling_clip_min,
        correction.vllm_importance_sampling_clip_max,
    )


def _optimizer_step(
    placement: Placement, optimizer, scheduler, settings: UpdateSettings, distributed: DistributedContext
) -> torch.Tensor:
    parameters = [p for p in placement.module.parameters() if p.requires_grad]
    if not placement.is_sharded:  # FSDP reduce-scatters in the backward pass
        distributed.all_reduce_gradients(parameters)
    max_norm = settings.max_grad_norm if settings.max_grad_norm > 0 else float("inf")
    grad_norm = clip_gradients(parameters, max_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def nonfinite_weights(placement: Placement, distributed: DistributedContext) -> torch.Tensor:
    """1.0 when a trainable weight (on any rank) holds NaN or infinity, else 0.0: one pass over
    the weights and one sync, so that a diverged update stops the run before it samples."""
    local = [
        getattr(p, "_local_tensor", p).detach() for p in placement.module.parameters() if p.requires_grad
    ]
    norms = torch._foreach_norm(local) if local else []
    bad = torch.stack([~torch.isfinite(norm) for norm in norms]).any().float() if norms else torch.zeros(())
    return distributed.all_reduce(bad.to(placement.device), op="max")
