"""The learner: `num_iterations` optimizer steps of the placed policy on one generation batch, in
named stages (prepare, forward-backward per micro-batch, optimizer step), its metrics summed on the
device by a `MetricsAccumulator`.

Over several ranks, each runs its own micro-batches and the gradients are summed over ranks before
clipping (by `all_reduce_gradients` for a replicated model, by FSDP's reduce-scatter for a sharded
one, whose forward passes run inside its root: `grpoflow.policy.placement`); the models come with
their `Placement`, through which every forward pass runs. The loss is normalised by the global
batch's totals (dapo's completion tokens, dr_grpo's completions; grpo weighs each micro-batch by
its share of the batch's completions, bnpo averages over the micro-batches of every rank), so the
summed gradient equals one process's on the whole batch split into the same micro-batches.

Under `padding_free` every forward pass (policy, old policy, reference) runs on the micro-batch's
sequences packed into one row (`learn.logprobs`). A mixture-of-experts policy's routers are hooked
for each pass (`learn.moe`): they replay the engine's recorded routing, and the router's
load-balancing loss joins the policy loss.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch

from grpoflow.algo import (
    AdaptiveEntropy,
    BatchTotals,
    entropy_bonus,
    exact_draw_weights,
    high_entropy_mask,
    micro_batch_scale,
    off_policy_mask,
    policy_loss,
    sampling_correction,
    sampling_logp_gap,
    sequence_kl,
)
from grpoflow.distributed import DistributedContext
from grpoflow.learn.accumulator import MetricsAccumulator
from grpoflow.learn.distribution_check import DistributionTap
from grpoflow.learn.logprobs import batch_logprobs, frozen_logprobs
from grpoflow.learn.micro_batches import MicroBatch, PreparedBatch, micro_batches
from grpoflow.learn.moe import MoeTraining
from grpoflow.learn.objective import AlgorithmConfig
from grpoflow.learn.update import ImportanceCorrection, UpdateSettings
from grpoflow.phases import phase
from grpoflow.policy.placement import Placement, clip_gradients
from grpoflow.policy.routing_replay import RoutingRecord
from grpoflow.rollout.batch import RolloutBatch


class Learner:
    """Updates the placed policy on generation batches with its optimizer and schedule, carrying the
    entropy bonus's coefficient from step to step.

    Under `distributed`, each rank holds its own slice of every batch (equally many rows on every
    rank) and its metrics are its own, to be averaged over ranks.
    """

    def __init__(
        self,
        placement: Placement,
        optimizer: torch.optim.Optimizer,
        scheduler,
        settings: UpdateSettings,
        *,
        ref_placement: Placement | None = None,
        distributed: DistributedContext | None = None,
    ) -> None:
        self.placement, self.ref_placement = placement, ref_placement
        self.optimizer, self.scheduler = optimizer, scheduler
        self.settings = settings
        self.distributed = distributed or DistributedContext()
        self.entropy_control: AdaptiveEntropy = settings.algorithm.entropy_control()
        self.loss_settings = settings.algorithm.loss_settings()
        reference = ref_placement.module if ref_placement is not None else None
        self.moe = MoeTraining(settings.algorithm.moe, placement.module, reference)

    def learn(
        self, batch: RolloutBatch, advantages: torch.Tensor, *, sampling_logprobs: bool = True
    ) -> dict[str, float]:
        """`num_iterations` optimizer steps on one generation batch; the metrics averaged over
        micro-batches and steps (`.../min` and `.../max` their extremes).

        advantages: (batch,). Tokens without a loss (inserted by an environment, or of completions
        masked out, e.g. truncated ones under overlong filtering) must have zeros in
        `batch.loss_mask`. `sampling_logprobs=False`: the batch lacks the engine's log-probs, so
        there is no importance-sampling correction against them and no gap to log.
        """
        settings = self.settings
        if not sampling_logprobs:
            settings = replace(settings, sampling_correction=None, sampling_logprobs=False)
        prepared = self.prepare(batch, advantages, settings)
        metrics = MetricsAccumulator()
        self.placement.module.train()
        for iteration in range(settings.algorithm.num_iterations):
            window = EntropyWindow()
            for index, micro in enumerate(prepared.micro_batches):
                last = index == len(prepared.micro_batches) - 1
                with self.moe.policy_pass(prepared.replay_routing) as routing:
                    metrics.add(
                        self.forward_backward(
                            prepared,
                            micro,
                            first_pass=iteration == 0,
                            last=last,
                            window=window,
                            routing=routing,
                        )
                    )
            metrics.add(self.optimizer_step(window))
        metrics.add({"weights/nonfinite": nonfinite_weights(self.placement, self.distributed)})
        return metrics.result()

    def prepare(
        self, batch: RolloutBatch, advantages: torch.Tensor, settings: UpdateSettings
    ) -> PreparedBatch:
        """The rows (longest first under `group_by_length`) cut into micro-batches with their
        advantages, old-policy log-probs (num_iterations > 1), reference log-probs (a KL term in
        the loss) and the batch's totals over every rank. The importance weights come with the
        first pass: before the first optimizer step the policy's own log-probs are the old ones."""
        if settings.group_by_length:
            order = batch.by_length()
            batch, advantages = batch.take(order), advantages[order.to(advantages.device)]
        parts = micro_batches(batch, settings, self.distributed)
        replay = self.moe.replays(batch)
        old: list[torch.Tensor | None] = [None] * len(parts)
        ref: list[torch.Tensor | None] = [None] * len(parts)
        if settings.algorithm.num_iterations > 1:
            with phase("old_logprobs"):
                old = frozen_logprobs(self.placement, parts, settings, self.moe.routers, replay)
        if self.ref_placement is not None and not settings.algorithm.kl_in_reward:
            with self.ref_placement.in_use(), phase("reference"):
                ref = frozen_logprobs(self.ref_placement, parts, settings, self.moe.ref_routers, replay)
        world_size = self.distributed.world_size
        totals = BatchTotals(
            num_items_in_batch=self.distributed.all_reduce(batch.loss_mask.sum()).clamp(min=1),
            num_sequences_in_batch=len(batch) * world_size,
            max_completion_length=settings.max_completion_length,
        )
        split = advantages.split([len(part) for part in parts])
        return PreparedBatch(
            [MicroBatch(*fields) for fields in zip(parts, split, old, ref)],
            totals,
            num_micro_batches=len(parts) * world_size,
            settings=settings,
            replay_routing=replay,
        )

    def forward_backward(
        self,
        prepared: PreparedBatch,
        micro: MicroBatch,
        *,
        first_pass: bool,
        last: bool,
        window: EntropyWindow,
        routing: RoutingRecord | None = None,
    ) -> dict[str, torch.Tensor]:
        """One micro-batch's forward pass, loss and backward pass (its gradients add to those of
        the step's other micro-batches; `last` lets a sharded model reduce them); its metrics.
        The entropy bonus's tokens and entropies go into `window`; a MoE policy's routing into
        `routing` (hooked by the caller over the backward pass too)."""
        settings, num_micro_batches = prepared.settings, prepared.num_micro_batches
        tap = None
        if first_pass:
            tap = DistributionTap.for_rows(self.placement, micro.rows, settings.temperature)
        with tap if tap is not None else contextlib.nullcontext():
            logps, entropy = batch_logprobs(
                self.placement,
                micro.rows,
                settings,
                entropy=True,
                entropy_grad=self.entropy_control.enabled,
                routing=routing,
                on_pack=None if tap is None else tap.packed,
            )
        before_update = logps.detach() if micro.old_logps is None else micro.old_logps
        sampler_metrics = _compare_sampler(micro, before_update, settings) if first_pass else {}
        sampled_by = micro.rows.sampling_logps if settings.sampling_logprobs else before_update
        token_mask, loss_weights = _token_weights(settings.algorithm, logps, entropy, micro, sampled_by)
        loss, metrics = policy_loss(
            logps,
            micro.old_logps,
            micro.advantages,
            micro.rows.loss_mask,
            self.loss_settings,
            prepared.totals,
            ref_logps=micro.ref_logps,
            is_weights=micro.is_weights,
            loss_weights=loss_weights,
        )
        metrics.update(sampler_metrics)
        if tap is not None:
            metrics.update(tap.metrics())
        scale = micro_batch_scale(
            self.loss_settings.loss_type,
            num_micro_batches,
            len(micro.rows),
            prepared.totals.num_sequences_in_batch,
        )
        total = loss * scale
        if self.entropy_control.enabled:
            effective = micro.rows.loss_mask if token_mask is None else micro.rows.loss_mask * token_mask
            window.add(entropy.detach(), effective)
            bonus = entropy_bonus(entropy, effective)
            total = total - self.entropy_control.applied_coef() * bonus / num_micro_batches
            metrics["policy_loss"] = loss.detach() * scale * num_micro_batches
        total = total + self.moe.loss_term(
            routing, metrics, num_micro_batches=num_micro_batches, first_pass=first_pass
        )
        self.placement.sync_gradients(last=last)
        total.backward()
        # The whole batch's loss as this micro-batch estimates it; the mean over micro-batches
        # and ranks is the whole batch's loss.
        metrics["loss"] = total.detach() * num_micro_batches
        mask = micro.rows.loss_mask.to(entropy.dtype)
        metrics["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
        return metrics

    def optimizer_step(self, window: EntropyWindow) -> dict[str, torch.Tensor | float]:
        """Move the adaptive entropy coefficient by the step's entropy (`window`), then step the
        optimizer and the schedule on the gradients summed over ranks and clipped; metrics
        `entropy_coef` (when the bonus is on) and `grad_norm`."""
        metrics: dict[str, torch.Tensor | float] = {}
        if self.entropy_control.enabled:
            self.entropy_control.step(window.mean(self.distributed))
            metrics["entropy_coef"] = self.entropy_control.coef
        self.placement.shard_all()
        parameters = [p for p in self.placement.module.parameters() if p.requires_grad]
        if not self.placement.is_sharded:  # FSDP reduce-scatters in the backward pass
            self.distributed.all_reduce_gradients(parameters)
        max_grad_norm = self.settings.max_grad_norm
        grad_norm = clip_gradients(
            parameters, max_grad_norm if max_grad_norm > 0 else float("inf"), self.placement.expert_group
        )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics["grad_norm"] = grad_norm.detach()
        return metrics

    def reward_kl(self, batch: RolloutBatch) -> torch.Tensor:
        """Each completion's KL to the reference, `(batch,)`: the sum over its loss tokens of the
        `kl_estimator` between the placed policy (before the update) and the reference model."""
        if self.ref_placement is None:
            raise ValueError(
                "reward_kl measures the KL to the reference model: give the Learner ref_placement"
            )
        parts = micro_batches(batch, self.settings, self.distributed)
        replay = self.moe.replays(batch)
        logps = frozen_logprobs(self.placement, parts, self.settings, self.moe.routers, replay)
        with self.ref_placement.in_use():
            ref = frozen_logprobs(self.ref_placement, parts, self.settings, self.moe.ref_routers, replay)
        estimator = self.settings.algorithm.kl_estimator
        return torch.cat(
            [
                sequence_kl(policy, reference, part.loss_mask, estimator)
                for policy, reference, part in zip(logps, ref, parts)
            ]
        )

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the learner: the optimizer's, schedule's and entropy
        coefficient's states."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "entropy_control": self.entropy_control.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s keys (a checkpoint without the entropy coefficient keeps the
        configured one)."""
        self.entropy_control.load_state_dict(state.get("entropy_control"))
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """`optimizer.load_state_dict(state)`, refusing a checkpoint whose parameter groups are not
    this run's (saved with another expert_model_parallel_size, LoRA or set of trained parameters)
    with the fix."""
    saved, ours = state.get("param_groups", []), optimizer.param_groups
    shapes = [len(group["params"]) for group in saved], [len(group["params"]) for group in ours]
    if shapes[0] != shapes[1]:
        raise ValueError(
            f"the checkpoint's optimizer holds parameter groups of {shapes[0]} parameters, this run's "
            f"{shapes[1]}: it was saved by a run that trained other parameters or split them otherwise "
            "(expert_model_parallel_size, LoRA, freezing); resume with the settings it was saved with, "
            "or start a new run from its weights (model: the checkpoint's directory) without resuming"
        )
    optimizer.load_state_dict(state)


@dataclass(slots=True)
class EntropyWindow:
    """The entropy summed over the entropy bonus's tokens in one optimizer step, and their count."""

    total: torch.Tensor | float = 0.0
    count: torch.Tensor | float = 0.0

    def add(self, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        """Add a micro-batch's `(rows, completion_len)` entropies on the tokens `mask` keeps."""
        self.total = self.total + (entropy * mask).sum()
        self.count = self.count + mask.sum()

    def mean(self, distributed: DistributedContext) -> float:
        """Mean entropy per token over every rank's tokens."""
        totals = distributed.all_reduce(torch.stack([self.total, self.count]).float())
        return float(totals[0] / totals[1].clamp(min=1))


def _compare_sampler(
    micro: MicroBatch, before_update: torch.Tensor, settings: UpdateSettings
) -> dict[str, torch.Tensor]:
    """On a batch's first pass: the importance weights against the engine's log-probs, kept on
    `micro` for every pass; without a correction, the log-prob gap to the engine; their metrics."""
    if settings.exact_draws:
        rows = micro.rows
        micro.is_weights, metrics = exact_draw_weights(before_update, rows.sampling_logps, rows.loss_mask)
        return metrics
    correction = settings.sampling_correction
    if correction is not None:
        micro.is_weights, metrics = _correction_weights(before_update, micro.rows, correction)
        return metrics
    if settings.sampling_logprobs:
        return sampling_logp_gap(before_update, micro.rows.sampling_logps, micro.rows.loss_mask)
    return {}


def _correction_weights(
    trainer_logps: torch.Tensor, rows: RolloutBatch, correction: ImportanceCorrection
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return sampling_correction(
        trainer_logps,
        rows.sampling_logps,
        rows.loss_mask,
        correction.vllm_importance_sampling_mode,
        correction.vllm_importance_sampling_clip_min,
        correction.vllm_importance_sampling_clip_max,
    )


def _token_weights(
    algorithm: AlgorithmConfig,
    logps: torch.Tensor,
    entropy: torch.Tensor,
    micro: MicroBatch,
    sampling_logps: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The high-entropy token mask (top_entropy_quantile) and the surrogate's weights: that mask
    times the off-policy sequence mask (off_policy_mask_threshold); None for what is off."""
    token_mask = None
    if algorithm.top_entropy_quantile < 1.0:
        token_mask = high_entropy_mask(entropy.detach(), micro.rows.loss_mask, algorithm.top_entropy_quantile)
    weights = token_mask
    if algorithm.off_policy_mask_threshold is not None:
        kept = off_policy_mask(
            micro.advantages, logps, sampling_logps, micro.rows.loss_mask, algorithm.off_policy_mask_threshold
        )
        weights = kept if weights is None else weights * kept
    return token_mask, weights


def nonfinite_weights(placement: Placement, distributed: DistributedContext) -> torch.Tensor:
    """1.0 when a trainable weight (on any rank) holds NaN or infinity, else 0.0: one pass over
    the weights and one sync, so that a diverged update stops the run before it samples."""
    local = [
        getattr(p, "_local_tensor", p).detach() for p in placement.module.parameters() if p.requires_grad
    ]
    norms = torch.stack(torch._foreach_norm(local)) if local else torch.zeros(1)
    bad = (~torch.isfinite(norms)).any().float()
    return distributed.all_reduce(bad.to(placement.device), op="max")
