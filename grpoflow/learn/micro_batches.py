"""A generation batch cut into micro-batches, and what the learner's passes read for each.

A token budget (`max_tokens_per_micro_batch`) makes micro-batches of unequal sizes; grpo-style
losses then weigh each by its share of the batch's sequences (`algo.micro_batch_scale`), so the
sum is still the whole batch's mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpoflow.algo import BatchTotals, token_budget_batches
from grpoflow.distributed import DistributedContext
from grpoflow.learn.update import UpdateSettings
from grpoflow.rollout.batch import RolloutBatch


def micro_batches(
    batch: RolloutBatch, settings: UpdateSettings, distributed: DistributedContext | None = None
) -> list[RolloutBatch]:
    """The batch's consecutive micro-batches: `micro_batch_size` rows each, or under a token
    budget as many rows as fit (`algo.token_budget_batches`), as many on every rank."""
    budget = settings.max_tokens_per_micro_batch
    extents = batch.row_extents()  # one wait for the device, not one per micro-batch
    if budget is None:
        size = settings.micro_batch_size
        return [
            batch.rows(start, min(start + size, len(batch)), extents) for start in range(0, len(batch), size)
        ]
    lengths = batch.sequence_lengths().tolist()
    ranges = token_budget_batches(lengths, budget)
    if distributed is not None and distributed.world_size > 1:
        # FSDP's collectives need every rank to run as many forward and backward passes.
        ranges = token_budget_batches(lengths, budget, min_batches=distributed.max_int(len(ranges)))
    return [batch.rows(rows.start, rows.stop, extents) for rows in ranges]


@dataclass(slots=True)
class MicroBatch:
    """One micro-batch's rows and the tensors its loss reads besides the policy's log-probs."""

    rows: RolloutBatch
    advantages: torch.Tensor
    """(rows,)"""
    old_logps: torch.Tensor | None = None
    """(rows, completion_len) under the policy before the update; None: the first pass's own
    (one optimizer step per batch, so the policy has not moved yet)."""
    ref_logps: torch.Tensor | None = None
    """(rows, completion_len) under the reference model; None without a KL term in the loss."""
    is_weights: torch.Tensor | None = None
    """(rows, completion_len) or (rows, 1) sampler-mismatch weights, set by the first pass under
    the importance-sampling correction."""


@dataclass(slots=True)
class PreparedBatch:
    """A generation batch ready for the forward-backward passes of every optimizer step."""

    micro_batches: list[MicroBatch]
    totals: BatchTotals
    """The whole batch's counts over every rank, which each micro-batch's loss divides by."""
    num_micro_batches: int
    """Micro-batches over every rank."""
    settings: UpdateSettings
    """This batch's settings (no sampler log-probs: no correction against them)."""
    replay_routing: bool = False
    """A MoE policy's passes replay the engine's recorded routing (`learn.moe`)."""
