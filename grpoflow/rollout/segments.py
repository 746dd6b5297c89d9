"""Rows of a `RolloutBatch` that hold several sequences (`sequence_starts`): a row per sequence for
the forward passes, and their per-token results put back where the batch has them.

An episode whose turns split into runs (`grpoflow.chat.trajectory`) is one row of the batch, its
later runs laid after its first. The model must see each run as the sequence it was sampled in:
positions from 0, attending to nothing of another run. So the forward passes run on a batch of one
row per sequence: each row's prompt and its completion tokens before its first start, then every
later sequence, its first token (a prompt token, mask 0, never scored) as its prompt and the rest
as its completion. Padded, these are the rows of a padded batch; under padding_free they pack as
any rows do (`algo.packing`), positions restarting at each. The per-token results (log-probs,
entropies) come back into the batch's `(batch, completion_len)` layout, 0 at each start and on
padding, with their gradients; the losses read one row per episode, as for any completion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpoflow.rollout.batch import RolloutBatch


@dataclass(frozen=True, slots=True)
class SequenceRows:
    """A batch's sequences as rows of their own, and where each of the batch's completion tokens
    lies among them."""

    batch: RolloutBatch
    """One row per sequence: each row's first sequence (in row order), then the later ones (row
    after row, in order); no `sequence_starts`."""
    row: Tensor
    """(batch, completion_len) long: the row of `batch` that scores each completion token."""
    column: Tensor
    """(batch, completion_len) long: its completion column there."""
    scored: Tensor
    """(batch, completion_len) bool: tokens that are scored (not a sequence's first token, not
    padding)."""

    def place(self, values: Tensor) -> Tensor:
        """`(sequences, columns)` per-token values of `batch` -> `(batch, completion_len)` in the
        split batch's layout, 0 where nothing is scored; keeps the grad."""
        return values[self.row, self.column].masked_fill(~self.scored, 0.0)


def split_sequences(batch: RolloutBatch) -> SequenceRows:
    """`batch`'s sequences, one row each (module docstring); `batch.sequence_starts` must be set."""
    if batch.sequence_starts is None:
        raise ValueError("split_sequences needs a batch with sequence_starts; this one has none")
    real = batch.completion_mask.bool()
    starts = batch.sequence_starts.bool() & real
    size, width = real.shape
    device = real.device
    start_rows, start_columns = starts.nonzero(as_tuple=True)  # row-major: the later sequences' order
    later = starts.long().cumsum(dim=1) > 0
    ordinal = (starts.flatten().long().cumsum(0).view(size, width) - 1).clamp(min=0)
    columns = torch.arange(width, device=device).expand(size, width)
    if start_columns.numel():
        shifted = columns - start_columns[ordinal] - 1
    else:
        shifted = columns
    scored = real & ~starts
    row = torch.where(later, size + ordinal, torch.arange(size, device=device)[:, None].expand(size, width))
    column = torch.where(later, shifted, columns)
    row, column = row.masked_fill(~scored, 0), column.masked_fill(~scored, 0)
    total = size + start_rows.numel()
    prompt_ids = batch.prompt_ids.new_zeros((total, batch.prompt_ids.shape[1]))
    prompt_mask = batch.prompt_mask.new_zeros(prompt_ids.shape)
    prompt_ids[:size], prompt_mask[:size] = batch.prompt_ids, batch.prompt_mask
    prompt_ids[size:, -1] = batch.completion_ids[start_rows, start_columns]
    prompt_mask[size:, -1] = 1
    completion_ids = batch.completion_ids.new_zeros((total, width))
    completion_mask = batch.completion_mask.new_zeros((total, width))
    completion_ids[row[scored], column[scored]] = batch.completion_ids[scored]
    completion_mask[row[scored], column[scored]] = 1
    sequences = RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        sampling_logps=torch.zeros(completion_ids.shape, device=device),
        truncated=torch.zeros(total, dtype=torch.bool, device=device),
        left_padded=not bool(prompt_mask.bool().all()),
    )
    return SequenceRows(sequences.rows(0, total), row, column, scored)
