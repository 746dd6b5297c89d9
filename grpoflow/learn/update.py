"""The policy-update phase: old and reference log-probs, micro-batched loss, optimizer steps.

Over several ranks, each runs its own micro-batches and the gradients are summed over ranks before
clipping (by `all_reduce_gradients` for a replicated model, by FSDP's reduce-scatter for a sharded
one, whose forward passes run inside its root: `grpoflow.policy.placement`); the models come with
their `Placement`, through which every forward pass runs. The loss is normalised by the global
batch's totals (dapo's completion tokens, dr_grpo's completions; grpo weighs each micro-batch by
its share of the batch's completions, bnpo averages over the micro-batches of every rank), so the summed gradient equals one process's on the whole batch
split into the same micro-batches.

Under `padding_free` every forward pass (policy, old policy, reference) runs on the micro-batch's
sequences packed into one row (`algo.packing`) and the log-probs come back padded, so the losses
see the same tensors. A token budget (`max_tokens_per_micro_batch`) makes micro-batches of unequal
sizes; grpo-style losses then weigh each by its share of the batch's sequences
(`algo.micro_batch_scale`), so the sum is still the whole batch's mean.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import torch

from grpoflow.algo import (
    AdaptiveEntropy,
    entropy_bonus,
    high_entropy_mask,
    micro_batch_scale,
    off_policy_mask,
    pack_sequences,
    packed_sequence_logprobs,
    policy_loss,
    sampling_correction,
    sampling_logp_gap,
    sequence_kl,
    sequence_logprobs,
    token_budget_batches,
)
from grpoflow.algo.truncation import Truncation
from grpoflow.distributed import DistributedContext
from grpoflow.engines import SamplingParams
from grpoflow.learn.objective import AlgorithmConfig
from grpoflow.options import require
from grpoflow.phases import phase
from grpoflow.policy.placement import Placement, clip_gradients
from grpoflow.rollout.batch import RolloutBatch


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
    truncation: Truncation | None = None
    """top-k/top-p/min-p replayed on the trainer's logits (`replay_sampling_truncation`)."""
    padding_free: bool = False
    """Run each micro-batch's forward passes on its sequences packed end to end in one row."""
    max_tokens_per_micro_batch: int | None = None
    """Form micro-batches by this budget of real tokens instead of `micro_batch_size` rows
    (padding_free only)."""
    group_by_length: bool = False
    """Order the rows longest first before cutting micro-batches (`RolloutBatch.by_length`)."""


def replayed_truncation(sampling: SamplingParams, algorithm: AlgorithmConfig) -> Truncation | None:
    """The filters the trainer replays on its logits: the run's top-k/top-p/min-p under
    `replay_sampling_truncation`, else None."""
    truncation = sampling.truncation
    return truncation if algorithm.replay_sampling_truncation and truncation.active else None


def micro_batches(
    batch: RolloutBatch, settings: UpdateSettings, distributed: DistributedContext | None = None
) -> list[RolloutBatch]:
    """The batch's consecutive micro-batches: `micro_batch_size` rows each, or under a token
    budget as many rows as fit (`algo.token_budget_batches`), as many on every rank."""
    budget = settings.max_tokens_per_micro_batch
    if budget is None:
        size = settings.micro_batch_size
        return [batch.rows(start, min(start + size, len(batch))) for start in range(0, len(batch), size)]
    lengths = batch.sequence_lengths().tolist()
    ranges = token_budget_batches(lengths, budget)
    if distributed is not None and distributed.world_size > 1:
        # FSDP's collectives need every rank to run as many forward and backward passes.
        ranges = token_budget_batches(lengths, budget, min_batches=distributed.max_int(len(ranges)))
    return [batch.rows(rows.start, rows.stop) for rows in ranges]


def batch_logprobs(
    placement: Placement,
    batch: RolloutBatch,
    settings: UpdateSettings,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (batch, completion_len) of the completion tokens under the placed model
    (and their entropy if asked), from the padded rows or, under `padding_free`, packed ones."""
    model = placement.module
    if settings.padding_free:
        packed = pack_sequences(
            batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
        )
        return placement.sharded_forward(
            lambda: packed_sequence_logprobs(
                model,
                packed,
                temperature=settings.temperature,
                chunk_size=settings.algorithm.logprob_chunk_size,
                compute_entropy=entropy,
                entropy_grad=entropy_grad,
                truncation=settings.truncation,
            ),
        )
    input_ids, attention_mask = batch.model_inputs()
    return placement.sharded_forward(
        lambda: sequence_logprobs(
            model,
            input_ids,
            attention_mask,
            logits_to_keep=batch.completion_ids.shape[1],
            temperature=settings.temperature,
            chunk_size=settings.algorithm.logprob_chunk_size,
            compute_entropy=entropy,
            entropy_grad=entropy_grad,
            truncation=settings.truncation,
        ),
    )


@torch.no_grad()
def frozen_logprobs(
    placement: Placement, parts: list[RolloutBatch], settings: UpdateSettings
) -> list[torch.Tensor]:
    """Log-probs of each micro-batch under the placed model without gradients (old policy,
    reference)."""
    with placement.evaluating():
        return [batch_logprobs(placement, part, settings)[0] for part in parts]


def reward_kl(
    placement: Placement,
    ref_placement: Placement,
    batch: RolloutBatch,
    settings: UpdateSettings,
    distributed: DistributedContext | None = None,
) -> torch.Tensor:
    """Each completion's KL to the reference, `(batch,)`: the sum over its loss tokens of the
    `kl_estimator` between the placed policy (before the update) and the reference model."""
    parts = micro_batches(batch, settings, distributed)
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
    entropy_control: AdaptiveEntropy | None = None,
) -> dict[str, float]:
    """Run `num_iterations` optimizer steps of the placed policy on one generation batch (with the
    placed reference model's log-probs, if any); return averaged metrics.

    entropy_control: the entropy bonus's coefficient, carried over steps (it moves after each
    optimizer step under adaptive control); None makes one from `settings.algorithm`.

    advantages: (batch,). Tokens without a loss (inserted by an environment, or of completions
    masked out, e.g. truncated ones under overlong filtering) must have zeros in `batch.loss_mask`. Under `distributed`, `batch` is this rank's
    slice (every rank holds equally many rows) and the metrics are this rank's, to be averaged
    over ranks.
    """
    distributed = distributed or DistributedContext()
    model = placement.module
    algorithm = settings.algorithm
    if settings.group_by_length:
        order = batch.by_length()
        batch, advantages = batch.take(order), advantages[order.to(advantages.device)]
    parts = micro_batches(batch, settings, distributed)
    starts = [0]
    for part in parts:
        starts.append(starts[-1] + len(part))
    old, ref = None, None
    if algorithm.num_iterations > 1:
        with phase("old_logprobs"):
            old = frozen_logprobs(placement, parts, settings)
    if ref_placement is not None and not algorithm.kl_in_reward:
        with ref_placement.in_use(), phase("reference"):
            ref = frozen_logprobs(ref_placement, parts, settings)
    num_items = distributed.all_reduce(batch.loss_mask.sum()).clamp(min=1)
    num_micro_batches = len(parts) * distributed.world_size
    num_sequences = len(batch) * distributed.world_size
    surrogate_settings = algorithm.surrogate_settings()
    entropy_control = entropy_control or algorithm.entropy_control()
    # Metrics stay on the device until the end: a float() per micro-batch would stall the GPU.
    totals: dict[str, torch.Tensor | float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    is_weights: list[torch.Tensor | None] = [None] * len(parts)
    window: list = [0.0, 0.0]  # entropy sum and token count of the entropy bonus's tokens this step
    model.train()
    for iteration in range(algorithm.num_iterations):
        first_pass = iteration == 0
        for index, part in enumerate(parts):
            logps, entropy = batch_logprobs(
                placement, part, settings, entropy=True, entropy_grad=entropy_control.enabled
            )
            correction_metrics = {}
            before_update = old[index] if old is not None else logps.detach()
            if settings.sampling_correction is not None and is_weights[index] is None:
                # Before the first optimizer step the policy's own log-probs are the old ones.
                is_weights[index], correction_metrics = _correction_weights(
                    before_update, part, settings.sampling_correction
                )
            elif settings.sampling_correction is None and settings.sampling_logprobs and first_pass:
                correction_metrics = sampling_logp_gap(before_update, part.sampling_logps, part.loss_mask)
            part_advantages = advantages[starts[index] : starts[index + 1]]
            sampled_by = part.sampling_logps if settings.sampling_logprobs else before_update
            token_mask, loss_weights = _token_weights(
                algorithm, logps, entropy, part, part_advantages, sampled_by
            )
            loss, metrics = policy_loss(
                logps,
                old[index] if old is not None else None,
                part_advantages,
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
                num_sequences_in_batch=num_sequences,
                is_weights=is_weights[index],
                surrogate_settings=surrogate_settings,
                loss_weights=loss_weights,
            )
            metrics.update(correction_metrics)
            scale = micro_batch_scale(algorithm.loss_type, num_micro_batches, len(part), num_sequences)
            total = loss * scale
            if entropy_control.enabled:
                effective = part.loss_mask if token_mask is None else part.loss_mask * token_mask
                bonus = entropy_bonus(entropy, effective)
                total = total - entropy_control.applied_coef() * bonus / num_micro_batches
                window[0] += (entropy.detach() * effective).sum()
                window[1] += effective.sum()
                metrics["policy_loss"] = loss.detach() * scale * num_micro_batches
            placement.sync_gradients(last=index == len(parts) - 1)
            total.backward()
            # The whole batch's loss as this micro-batch estimates it; the mean over micro-batches
            # and ranks is the whole batch's loss.
            metrics["loss"] = total.detach() * num_micro_batches
            mask = part.loss_mask.to(entropy.dtype)
            metrics["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
            for name, value in metrics.items():
                _accumulate(totals, counts, name, value.detach())
        if entropy_control.enabled:
            window_totals = distributed.all_reduce(torch.stack([window[0], window[1]]).float())
            entropy_control.step(float(window_totals[0] / window_totals[1].clamp(min=1)))
            totals["entropy_coef"] += entropy_control.coef
            counts["entropy_coef"] += 1
            window = [0.0, 0.0]
        grad_norm = _optimizer_step(placement, optimizer, scheduler, settings, distributed)
        totals["grad_norm"] += grad_norm.detach()
        counts["grad_norm"] += 1
    totals["weights/nonfinite"] = nonfinite_weights(placement, distributed)
    counts["weights/nonfinite"] = 1
    return {name: float(totals[name]) / counts[name] for name in totals}


def _token_weights(
    algorithm: AlgorithmConfig,
    logps: torch.Tensor,
    entropy: torch.Tensor,
    part: RolloutBatch,
    advantages: torch.Tensor,
    sampling_logps: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The high-entropy token mask (top_entropy_quantile) and the surrogate's weights: that mask
    times the off-policy sequence mask (off_policy_mask_threshold); None for what is off."""
    token_mask = None
    if algorithm.top_entropy_quantile < 1.0:
        token_mask = high_entropy_mask(entropy.detach(), part.loss_mask, algorithm.top_entropy_quantile)
    weights = token_mask
    if algorithm.off_policy_mask_threshold is not None:
        kept = off_policy_mask(
            advantages, logps, sampling_logps, part.loss_mask, algorithm.off_policy_mask_threshold
        )
        weights = kept if weights is None else weights * kept
    return token_mask, weights


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
