"""Loss types by name (verl's `register_policy_loss`): a surrogate, a reduction and its settings.

A loss type pairs a per-token surrogate (`surrogates.py`) with one of `LOSS_REDUCTIONS`, which
turns masked per-token losses into a scalar, and names the frozen dataclass of the surrogate's
hyperparameters. A plugin adds one with a decorator on its surrogate:

    @register_loss("my_loss", reduction="dapo", settings=MySettings)
    def my_loss(inputs: SurrogateInputs, settings: MySettings) -> tuple[Tensor, dict[str, Tensor]]:
        ...

The reductions, named after the loss type that introduced them:

- "grpo": per-sequence token mean, then mean over sequences, as in the GRPO paper.
- "bnpo": one token mean over the micro-batch.
- "dr_grpo": token sum over the constant `num_sequences * max_completion_length`, which removes the
  length bias of the per-sequence mean.
- "dapo": token sum over the number of completion tokens in the whole generation batch
  (`num_items_in_batch`), so micro-batches add up to the paper's token-level loss.
- "luspo": each sequence's token sum, averaged over sequences, so that at sequence level each
  sequence weighs by its length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from grpoflow.algo.registry import add_entry, entry


@dataclass(frozen=True, slots=True)
class BatchTotals:
    """Counts of the whole generation batch (over every rank) that a micro-batch's loss divides by,
    so that micro-batch losses add up to the batch's."""

    num_items_in_batch: Tensor | int | None = None
    """Completion tokens that count in the loss ("dapo"); None: the micro-batch's own."""
    num_sequences_in_batch: int | None = None
    """Completions ("dr_grpo"); None: the micro-batch's own."""
    max_completion_length: int | None = None
    """The generation limit; required by "dr_grpo"."""


def _reduce_grpo(per_token_loss: Tensor, mask: Tensor, totals: BatchTotals) -> Tensor:
    per_sequence = (per_token_loss * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return per_sequence.mean()


def _reduce_bnpo(per_token_loss: Tensor, mask: Tensor, totals: BatchTotals) -> Tensor:
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def _reduce_dr_grpo(per_token_loss: Tensor, mask: Tensor, totals: BatchTotals) -> Tensor:
    if totals.max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' divides by max_completion_length; pass it in the BatchTotals.")
    num_sequences = totals.num_sequences_in_batch
    num_sequences = mask.size(0) if num_sequences is None else num_sequences
    return (per_token_loss * mask).sum() / (num_sequences * totals.max_completion_length)


def _reduce_dapo(per_token_loss: Tensor, mask: Tensor, totals: BatchTotals) -> Tensor:
    num_items = mask.sum() if totals.num_items_in_batch is None else totals.num_items_in_batch
    num_items = torch.as_tensor(num_items, dtype=per_token_loss.dtype, device=per_token_loss.device)
    return (per_token_loss * mask).sum() / num_items.clamp(min=1.0)


def _reduce_luspo(per_token_loss: Tensor, mask: Tensor, totals: BatchTotals) -> Tensor:
    return (per_token_loss * mask).sum(dim=-1).mean()


@dataclass(frozen=True, slots=True)
class LossReduction:
    """How one loss type turns masked per-token losses into a scalar."""

    reduce: Callable[[Tensor, Tensor, BatchTotals], Tensor]
    """`(per_token_loss (batch, seq), mask (batch, seq), totals) -> 0-dim loss`."""
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

Surrogate = Callable[[Any, Any], tuple[Tensor, dict[str, Tensor]]]
"""`(SurrogateInputs, settings) -> (per-token loss (batch, seq) or (batch, 1), metrics)`."""


@dataclass(frozen=True, slots=True)
class LossType:
    """A per-token surrogate, the reduction of its per-token losses, and its settings' class."""

    surrogate: Surrogate
    reduction: LossReduction
    settings: type
    """The frozen dataclass of the surrogate's hyperparameters; its defaults are the loss's."""
    weighs_sampler_mismatch: bool = True
    """False when the surrogate folds the sampler-mismatch weights in itself (VESPO)."""


LOSS_TYPES: dict[str, LossType] = {}
"""Loss types by `loss_type` name, in the order they were registered (the order options list them)."""


def register_loss(
    name: str, *, reduction: str, settings: type, weighs_sampler_mismatch: bool = True
) -> Callable[[Surrogate], Surrogate]:
    """Decorator that registers a surrogate as loss type `name`, reduced by `LOSS_REDUCTIONS[reduction]`
    and configured by an instance of the dataclass `settings`; a name taken twice is an error (the
    same registration repeated, as by a module imported again, is none)."""
    reduce = entry(LOSS_REDUCTIONS, "loss reduction", reduction)

    def register(surrogate: Surrogate) -> Surrogate:
        add_entry(
            LOSS_TYPES, "loss_type", name, LossType(surrogate, reduce, settings, weighs_sampler_mismatch)
        )
        return surrogate

    return register


def loss_type(name: str) -> LossType:
    """The loss type registered under `name`; ValueError naming the known ones."""
    return entry(LOSS_TYPES, "loss_type", name)
