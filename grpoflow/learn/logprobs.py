"""Log-probs of a rollout batch's completion tokens under a placed model, from its padded rows or,
under `padding_free`, from its sequences packed end to end in one row (`algo.packing`); either
way they come back padded, so the losses see the same tensors. A row holding several sequences
(`RolloutBatch.sequence_starts`) is scored as a row per sequence (`rollout.segments`)."""

from __future__ import annotations

import torch

from grpoflow.algo import LogprobOptions, pack_sequences, packed_sequence_logprobs, sequence_logprobs
from grpoflow.learn.update import UpdateSettings
from grpoflow.policy.placement import Placement
from grpoflow.rollout.batch import RolloutBatch
from grpoflow.rollout.segments import split_sequences


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
    if batch.sequence_starts is not None and bool(batch.sequence_starts.any()):
        split = split_sequences(batch)
        logps, entropies = batch_logprobs(
            placement, split.batch, settings, entropy=entropy, entropy_grad=entropy_grad
        )
        return split.place(logps), None if entropies is None else split.place(entropies)
    model = placement.module
    options = LogprobOptions(
        temperature=settings.temperature,
        chunk_size=settings.algorithm.logprob_chunk_size,
        compute_entropy=entropy,
        entropy_grad=entropy_grad,
        truncation=settings.truncation,
    )
    if settings.padding_free:
        packed = pack_sequences(
            batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
        )
        return placement.sharded_forward(lambda: packed_sequence_logprobs(model, packed, options))
    input_ids, attention_mask = batch.model_inputs()
    logits_to_keep = batch.completion_ids.shape[1]
    return placement.sharded_forward(
        lambda: sequence_logprobs(model, input_ids, attention_mask, logits_to_keep, options)
    )


@torch.no_grad()
def frozen_logprobs(
    placement: Placement, parts: list[RolloutBatch], settings: UpdateSettings
) -> list[torch.Tensor]:
    """Log-probs of each micro-batch under the placed model without gradients (old policy,
    reference)."""
    with placement.evaluating():
        return [batch_logprobs(placement, part, settings)[0] for part in parts]
