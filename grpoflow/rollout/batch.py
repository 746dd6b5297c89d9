"""Groups to padded training tensors: the `RolloutBatch` the learner reads.

One row per completion, whatever the completion: an episode whose turns split into several runs
(`grpoflow.chat.trajectory`) is one row too, its later runs' sequences laid after its first in
the completion columns and marked in `sequence_starts`; the learner's forward passes keep them
apart (`grpoflow.rollout.segments`). So every loss normaliser counts what it counts for any
completion: a row, i.e. one episode, for those over sequences (grpo's per-sequence token mean,
dr_grpo's `num_sequences`, luspo; GSPO's sequence-level ratio), and the loss tokens (mask 1) for
those over tokens (dapo, bnpo). An episode of two sequences weighs exactly as an episode of one
sequence with the same sampled tokens: the prompt tokens of a later sequence have mask 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from grpoflow.engines import Completion
from grpoflow.rollout.groups import Group


@dataclass(frozen=True, slots=True)
class EngineDistributions:
    """The engine's whole next-token distributions at the positions it kept
    (`Completion.distributions`), which the learner compares with its own."""

    log_probs: torch.Tensor
    """(kept, vocab) float32 `log_softmax(logits / T)`."""


@dataclass(slots=True)
class RolloutBatch:
    """Padded tensors of a generation batch; rows are consecutive groups of G completions."""

    prompt_ids: torch.Tensor
    """(batch, prompt_len) left-padded."""
    prompt_mask: torch.Tensor
    """(batch, prompt_len) 1 on real tokens."""
    completion_ids: torch.Tensor
    """(batch, completion_len) right-padded."""
    completion_mask: torch.Tensor
    """(batch, completion_len) 1 on real tokens."""
    sampling_logps: torch.Tensor
    """(batch, completion_len) the engine's log-probs of the sampled tokens."""
    truncated: torch.Tensor
    """(batch,) bool: the completion hit max_completion_length."""
    left_padded: bool = True
    """Some prompt is left-padded. When none is, the causal mask alone hides every padding
    token (completions are padded on the right), so the model runs without an attention mask."""
    loss_mask: torch.Tensor | None = None
    """(batch, completion_len) 1 on the tokens that get a loss: those the policy sampled (not
    those an environment inserted), less any filtered out; `completion_mask` when unset."""
    sequence_starts: torch.Tensor | None = None
    """(batch, completion_len) bool: True on a completion token that begins another sequence of
    its row (the first token of that sequence's prompt; mask 0): positions restart there and no
    token attends across it. None: every row is its prompt then its completion, one sequence."""
    routed_experts: torch.Tensor | None = None
    """(batch, prompt_len + completion_len, num_moe_layers, top_k) int16 on the CPU: the experts
    the engine routed each position of `model_inputs()` to (`Completion.routed_experts`), -1 on
    padding and where nothing was recorded; moved to the device one micro-batch at a time. None:
    no completion recorded its routing."""

    distribution_index: torch.Tensor | None = None
    """(batch, completion_len) long: the row of `engine_distributions` holding the engine's whole
    next-token distribution at that token, -1 where it kept none. None: it kept none at all."""
    engine_distributions: EngineDistributions | None = None
    """The rows `distribution_index` points into."""

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.completion_mask.clone()

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(batch, prompt_len + completion_len)` input ids and the attention mask, None when no
        prompt is left-padded (the causal mask then hides the right padding)."""
        input_ids = torch.cat([self.prompt_ids, self.completion_ids], dim=1)
        if not self.left_padded:
            return input_ids, None
        return input_ids, torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def sequence_lengths(self) -> torch.Tensor:
        """(batch,) each row's real tokens, prompt and completion."""
        return self.prompt_mask.sum(dim=1) + self.completion_mask.sum(dim=1)

    def by_length(self) -> torch.Tensor:
        """Row indices from the longest sequence (prompt and completion tokens) to the shortest,
        ties in row order."""
        return torch.sort(self.sequence_lengths(), descending=True, stable=True).indices

    def take(self, rows: torch.Tensor) -> RolloutBatch:
        """The rows `rows` (indices), in that order."""
        tensors = {item.name: getattr(self, item.name) for item in fields(self)}
        return replace(
            self,
            **{
                name: value[rows.to(value.device)]
                for name, value in tensors.items()
                if isinstance(value, torch.Tensor)
            },
        )

    def row_extents(self) -> tuple[list[int], list[int]]:
        """Per row, its first prompt column holding a token (the width for none) and the end of its
        completion's last token's column (0 for none), in one copy to the host: what `rows` cuts."""
        return _extents(self.prompt_mask, self.completion_mask)

    def rows(self, start: int, stop: int, extents: tuple[list[int], list[int]] | None = None) -> RolloutBatch:
        """Rows [start, stop) with the all-padding columns cut away; `extents`: the whole batch's
        `row_extents()` (else the rows' own are read, a wait for the device each time)."""
        if extents is None:
            firsts, ends = _extents(self.prompt_mask[start:stop], self.completion_mask[start:stop])
        else:
            firsts, ends = extents[0][start:stop], extents[1][start:stop]
        prompt_mask = self.prompt_mask[start:stop]
        completion_mask = self.completion_mask[start:stop]
        first = min(firsts, default=0)
        first = 0 if first == prompt_mask.shape[1] else first
        last = max(max(ends, default=0), 1)
        return RolloutBatch(
            prompt_ids=self.prompt_ids[start:stop, first:],
            prompt_mask=prompt_mask[:, first:],
            completion_ids=self.completion_ids[start:stop, :last],
            completion_mask=completion_mask[:, :last],
            sampling_logps=self.sampling_logps[start:stop, :last],
            truncated=self.truncated[start:stop],
            left_padded=self.left_padded and len(set(firsts)) > 1,
            loss_mask=self.loss_mask[start:stop, :last],
            sequence_starts=None if self.sequence_starts is None else self.sequence_starts[start:stop, :last],
            distribution_index=(
                None if self.distribution_index is None else self.distribution_index[start:stop, :last]
            ),
            engine_distributions=self.engine_distributions,
            routed_experts=None
            if self.routed_experts is None
            else self.routed_experts[start:stop, first : self.prompt_ids.shape[1] + last],
        )


def collate(groups: Sequence[Group], pad_token_id: int, device: torch.device) -> RolloutBatch:
    """Pad every completion of every group into one batch of tensors on `device`, with where
    each completion's later sequences start (`Group.sequence_starts`)."""
    pairs = [(group.item.prompt_ids, c) for group in groups for c in group.completions]
    starts = [
        list(offsets)
        for group in groups
        for offsets in (group.sequence_starts or [[]] * len(group.completions))
    ]
    return collate_pairs(pairs, pad_token_id, device, starts if any(starts) else None)


def collate_pairs(
    pairs: Sequence[tuple[Sequence[int], Completion]],
    pad_token_id: int,
    device: torch.device,
    sequence_starts: Sequence[Sequence[int]] | None = None,
) -> RolloutBatch:
    """Pad `(prompt ids, completion)` pairs into one batch of tensors on `device`: prompts on the
    left, completions on the right. Each field goes in as one flat tensor, scattered through a
    row-major mask (a row's positions in order, row after row: the pairs' order).
    `sequence_starts`: per pair, the completion offsets where another sequence begins (each a
    token the completion's mask leaves out of the loss)."""
    prompt_lengths = np.array([len(prompt) for prompt, _ in pairs], dtype=np.int64)
    lengths = np.array([len(c.token_ids) for _, c in pairs], dtype=np.int64)
    prompt_len = int(prompt_lengths.max())
    completion_len = max(1, int(lengths.max()))
    prompt_held = np.arange(prompt_len) >= prompt_len - prompt_lengths[:, None]
    filled = np.arange(completion_len) < lengths[:, None]
    prompt_mask, completion_mask = torch.from_numpy(prompt_held).long(), torch.from_numpy(filled).long()
    prompt_ids = _scatter((p for p, _ in pairs), pad_token_id, np.int64, prompt_held, "prompts' ids")
    completion_ids = _scatter(
        (c.token_ids for _, c in pairs), pad_token_id, np.int64, filled, "completions' token_ids"
    )
    sampling_logps = _scatter(
        (c.logprobs for _, c in pairs), 0.0, np.float32, filled, "completions' logprobs"
    )
    if all(c.mask is None for _, c in pairs):
        loss_mask = completion_mask.clone()
    else:
        loss_mask = _scatter((c.loss_mask for _, c in pairs), 0, np.int64, filled, "completions' masks")
    truncated = torch.tensor([c.truncated for _, c in pairs], dtype=torch.bool)
    starts = None if sequence_starts is None else _starts(sequence_starts, pairs, completion_mask, loss_mask)
    index, distributions = _distributions(pairs, completion_mask.shape, device)
    return RolloutBatch(
        distribution_index=index,
        engine_distributions=distributions,
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        completion_ids=completion_ids.to(device),
        completion_mask=completion_mask.to(device),
        sampling_logps=sampling_logps.to(device),
        truncated=truncated.to(device),
        left_padded=len({len(prompt) for prompt, _ in pairs}) > 1,
        loss_mask=loss_mask.to(device),
        sequence_starts=None if starts is None else starts.to(device),
        routed_experts=_routed_experts(pairs, prompt_len, completion_len),
    )


def _starts(
    offsets: Sequence[Sequence[int]],
    pairs: Sequence[tuple[Sequence[int], Completion]],
    completion_mask: torch.Tensor,
    loss_mask: torch.Tensor,
) -> torch.Tensor:
    """(batch, completion_len) bool: True at each pair's sequence starts, which must lie inside its
    completion, on a token without a loss."""
    if len(offsets) != len(pairs):
        raise ValueError(
            f"sequence_starts has {len(offsets)} entries for {len(pairs)} completions: give one each"
        )
    starts = torch.zeros_like(completion_mask, dtype=torch.bool)
    for row, (row_offsets, (_, completion)) in enumerate(zip(offsets, pairs)):
        for offset in row_offsets:
            if not 0 <= offset < len(completion.token_ids) or loss_mask[row, offset]:
                raise ValueError(
                    f"completion {row}'s sequence start {offset} must be a token of its completion "
                    f"({len(completion.token_ids)} tokens) whose mask is 0: the first token of that "
                    "sequence's prompt"
                )
            starts[row, offset] = True
    return starts


def _distributions(
    pairs: Sequence[tuple[Sequence[int], Completion]], shape: torch.Size, device: torch.device
) -> tuple[torch.Tensor | None, EngineDistributions | None]:
    """`distribution_index` and `engine_distributions` of the pairs' kept distributions."""
    kept = [
        (row, position, values)
        for row, (_, completion) in enumerate(pairs)
        for position, values in sorted((completion.distributions or {}).items())
        if position < len(completion.token_ids)
    ]
    if not kept:
        return None, None
    index = torch.full(shape, -1, dtype=torch.long)
    for number, (row, position, _) in enumerate(kept):
        index[row, position] = number
    rows = torch.stack([values.to(device, torch.float32) for _, _, values in kept])
    return index.to(device), EngineDistributions(rows)


def _routed_experts(
    pairs: Sequence[tuple[Sequence[int], Completion]], prompt_len: int, completion_len: int
) -> torch.Tensor | None:
    """The completions' recorded experts in the batch's layout (`RolloutBatch.routed_experts`):
    prompts' positions on the left of column `prompt_len`, completions' from it; None when no
    completion recorded them."""
    recorded = [c.routed_experts for _, c in pairs if c.routed_experts is not None]
    if not recorded:
        return None
    _, layers, top_k = recorded[0].shape
    out = torch.full((len(pairs), prompt_len + completion_len, layers, top_k), -1, dtype=torch.int16)
    for row, (prompt, completion) in enumerate(pairs):
        experts = completion.routed_experts
        if experts is None:
            continue
        length = len(prompt) + len(completion.token_ids)
        if tuple(experts.shape) != (length, layers, top_k):
            raise ValueError(
                f"completion {row}'s routed_experts has shape {tuple(experts.shape)}; its prompt and "
                f"completion need ({length}, {layers}, {top_k}): one row per position, as the batch's other completions"
            )
        out[row, prompt_len - len(prompt) : prompt_len + len(completion.token_ids)] = experts.to(torch.int16)
    return out


def _scatter(
    lists: Iterable[Sequence], fill: float, dtype: type, where: np.ndarray, name: str
) -> torch.Tensor:
    """The lists laid into the True cells of `where`, row after row (`fill` elsewhere), in one
    pass over their values; a ValueError naming `name` when they hold another number of values."""
    flat, positions = np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype), int(where.sum())
    if flat.size != positions:
        raise ValueError(
            f"the {name} hold {flat.size} values for {positions} positions: "
            "give one per token of each completion"
        )
    out = np.full(where.shape, fill, dtype=dtype)
    out[where] = flat
    return torch.from_numpy(out)


def _extents(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """`RolloutBatch.row_extents` of these masks."""
    held = prompt_mask.bool()
    firsts = torch.where(held.any(1), held.int().argmax(1), prompt_mask.shape[1])
    columns = torch.arange(1, completion_mask.shape[1] + 1, device=completion_mask.device)
    ends = (
        (completion_mask.bool() * columns).amax(1) if completion_mask.shape[1] else torch.zeros_like(firsts)
    )
    extents = torch.cat([firsts, ends]).tolist()
    return extents[: len(firsts)], extents[len(firsts) :]
