"""Log-probs of a rollout batch's completion tokens under a placed model: from its padded rows,
under `shared_prompts` from each group's prompt packed once with its completions after it
(`algo.shared_prompts`), or under `padding_free` from its sequences packed end to end in one row
(`algo.packing`); either way they come back padded, so the losses see the same tensors. A row
holding several sequences (`RolloutBatch.sequence_starts`) is scored as a row per sequence
(`rollout.segments`). A MoE policy's forward passes bind the batch's recorded routing, in the order
the forward takes its tokens, to the routers' hooks (`policy.routing_replay`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from grpoflow.algo import LogprobOptions, pack_sequences, packed_sequence_logprobs, sequence_logprobs
from grpoflow.algo.packing import PackedSequences, attention_implementation
from grpoflow.algo.shared_prompts import pack_shared_prompts
from grpoflow.learn.update import UpdateSettings
from grpoflow.policy import varlen_attention
from grpoflow.policy.placement import Placement
from grpoflow.policy.routing_replay import MoeRouters, RoutingRecord
from grpoflow.policy.unpacked_forward import unpacked_positions
from grpoflow.rollout.batch import RolloutBatch
from grpoflow.rollout.segments import split_sequences


def batch_logprobs(
    placement: Placement,
    batch: RolloutBatch,
    settings: UpdateSettings,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    routing: RoutingRecord | None = None,
    on_pack: Callable[[PackedSequences], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (batch, completion_len) of the completion tokens under the placed model
    (and their entropy if asked), from the padded rows or packed ones (shared prompts,
    `padding_free`). `routing`: the record a MoE policy's hooked routers read the batch's routing
    from; `on_pack` is told the pack when the rows run packed."""
    if batch.sequence_starts is not None and bool(batch.sequence_starts.any()):
        split = split_sequences(batch)
        logps, entropies = batch_logprobs(
            placement, split.batch, settings, entropy=entropy, entropy_grad=entropy_grad, routing=routing
        )
        return split.place(logps), None if entropies is None else split.place(entropies)
    if routing is not None:
        routing.bind(*routing_layout(batch, settings.padding_free, placement.device))
    model = placement.module
    options = LogprobOptions(
        temperature=settings.temperature,
        chunk_size=settings.algorithm.logprob_chunk_size,
        compute_entropy=entropy,
        entropy_grad=entropy_grad,
        truncation=settings.truncation,
    )
    packed = None
    if settings.shared_prompts and routing is None and attends_varlen(model):
        packed = pack_shared_prompts(
            batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
        )
    if packed is None and settings.padding_free:
        packed = pack_sequences(
            batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
        )
    if packed is not None:
        if on_pack is not None:
            on_pack(packed)
        return placement.sharded_forward(lambda: packed_sequence_logprobs(model, packed, options))
    input_ids, attention_mask = batch.model_inputs()
    logits_to_keep = batch.completion_ids.shape[1]
    with nullcontext() if attention_mask is not None else unpacked_positions():  # no mask: no padding
        return placement.sharded_forward(
            lambda: sequence_logprobs(model, input_ids, attention_mask, logits_to_keep, options)
        )


def attends_varlen(model: torch.nn.Module) -> bool:
    """The model attends with grpoflow_varlen, which reads a packed row's key index (a model
    attending otherwise would ignore it and attend across the packed sequences)."""
    return attention_implementation(model) == varlen_attention.NAME


def routing_layout(
    batch: RolloutBatch, padding_free: bool, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The batch's recorded experts `(tokens, layers, top_k)` in the order its forward pass takes
    the tokens (row after row; packed: the real ones only), and its real tokens `(rows, columns)`
    (None when packed: every token is real)."""
    real = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    routed = batch.routed_experts
    if padding_free:
        return (None if routed is None else routed[real.bool().to(routed.device)].to(device)), None
    return (None if routed is None else routed.flatten(0, 1).to(device)), real


@torch.no_grad()
def frozen_logprobs(
    placement: Placement,
    parts: list[RolloutBatch],
    settings: UpdateSettings,
    routers: MoeRouters | None = None,
    replay: bool = False,
) -> list[torch.Tensor]:
    """Log-probs of each micro-batch under the placed model without gradients (old policy,
    reference); a MoE model's `routers` replay the recorded routing under `replay`."""
    with placement.evaluating():
        if routers is None:
            return [batch_logprobs(placement, part, settings)[0] for part in parts]
        logps = []
        for part in parts:
            with routers.hooked(RoutingRecord(replay=replay)) as record:
                logps.append(batch_logprobs(placement, part, settings, routing=record)[0])
        return logps
