"""Padding-free updates: sequences packed end to end in one row, and micro-batches by token budget.

A padded micro-batch costs `rows x (longest prompt + longest completion)` tokens; with long-tailed
completion lengths most of that rectangle is padding. Packed, a micro-batch is one row holding
only real tokens, each sequence's positions restarting at 0, and costs what its tokens cost.

Attention stays within each sequence through transformers' own mask builder (`masking_utils`;
5.19 is installed here): given `position_ids` that restart and no `attention_mask`, it finds the
sequence starts (`find_packed_sequence_indices`) and every attention implementation keeps to
them: `sdpa` and `eager` with a block-diagonal causal mask, `flex_attention` with a document mask
whose fully masked blocks are skipped, `flash_attention_2`/`3` with varlen kernels (`cu_seqlens`
from the same position ids). This path is chosen because it runs unchanged on the CPU, which the
tests need, and on CUDA without the flash-attn package, for Qwen2, Qwen3 and Llama alike (packed
equals padded for each, tested), and leaves the kernel to the model's `attn_implementation`.
Its cost with the default `sdpa`: a `(tokens, tokens)` boolean mask per micro-batch, and attention
over every block of it, about `4 x tokens x hidden` FLOPs per token and layer whatever the
sequence lengths; so token budgets of a few thousand keep attention near the MLPs' cost, and
`flex_attention` skips the masked blocks. torch's `torch.nn.attention.varlen.varlen_attn` (torch
2.13) is CUDA-only and transformers does not dispatch Qwen2/Llama attention to it, so it would
need an attention function of grpoflow's own that the CPU tests cannot run; it is not used.

The per-token results are scattered back into the padded `(batch, completion_len)` layout
(`unpack`), so every loss reduction runs unchanged and gives the padded path's result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

PACKED_ATTENTION = (
    "sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "grpoflow_varlen",
)
"""transformers attention implementations that keep packed sequences apart by their positions."""


@dataclass(frozen=True, slots=True)
class PackedSequences:
    """A padded batch's real tokens end to end in one row, and where its completion tokens are."""

    input_ids: Tensor
    """(1, tokens) each row's prompt then completion tokens, without padding."""
    position_ids: Tensor
    """(1, tokens) positions restarting at 0 at each sequence's first token."""
    score_index: Tensor
    """(scored,) packed index of the hidden state that predicts each completion token."""
    targets: Tensor
    """(scored,) the completion tokens, row by row."""
    completion_mask: Tensor
    """(batch, completion_len) bool: where `unpack` puts the scored values back."""
    cu_seq_lens: Tensor
    """(batch + 1,) int32: where each sequence starts in the row, and the row's length."""
    max_length: int
    """The longest sequence's tokens."""
    key_index: Tensor | None = None
    """(keys,) the packed token each sequence's keys come from, sequence after sequence, where
    sequences attend to tokens outside their own (`algo.shared_prompts`); None: each to itself."""
    cu_seq_lens_k: Tensor | None = None
    """(batch + 1,) int32: where each sequence's keys start in `key_index` (with it)."""
    max_length_k: int | None = None
    """The most keys of a sequence (with `key_index`)."""

    def attention_kwargs(self) -> dict:
        """The sequences' boundaries under transformers' names for them, for attention
        implementations that read them (flash_attention_2/3, grpoflow_varlen); others ignore them.
        With a key index only grpoflow_varlen reads them, and a placeholder 4D mask spares
        transformers building one over the whole row."""
        if self.key_index is None:
            return {
                "cu_seq_lens_q": self.cu_seq_lens,
                "cu_seq_lens_k": self.cu_seq_lens,
                "max_length_q": self.max_length,
                "max_length_k": self.max_length,
            }
        return {
            "attention_mask": torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.input_ids.device),
            "cu_seq_lens_q": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "key_index": self.key_index,
            "cu_seq_lens_k": self.cu_seq_lens_k,
            "max_length_k": self.max_length_k,
        }


def attention_implementation(model: nn.Module) -> str | None:
    """The attention implementation a transformers model (its text model's, for a multimodal one)
    runs; None for a model without a transformers config."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return getattr(config, "_attn_implementation", None)


def check_packed_attention(model: nn.Module) -> None:
    """Raise ValueError unless `model` is a transformers model whose attention implementation
    keeps packed sequences apart (`PACKED_ATTENTION`); any other would attend across them."""
    implementation = attention_implementation(model)
    if implementation not in PACKED_ATTENTION:
        raise ValueError(
            f"padding_free needs a transformers model whose attn_implementation is one of "
            f"{', '.join(PACKED_ATTENTION)}; this model's is {implementation!r}: load it with one "
            "of those or set padding_free: false."
        )


def pack_sequences(
    prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor
) -> PackedSequences:
    """Pack a padded batch (prompts left-padded, completions right-padded) into one row.

    Args:
        prompt_ids, prompt_mask: `(batch, prompt_len)`, mask 1 on real tokens.
        completion_ids, completion_mask: `(batch, completion_len)`, mask 1 on real tokens.

    Every row needs at least one prompt token: its first completion token is predicted by the
    hidden state of the token before it.
    """
    require_prompt_tokens(bool(prompt_mask.bool().any(dim=1).all()))
    mask = torch.cat([prompt_mask, completion_mask], dim=1).bool()  # (batch, seq)
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    # Row-major order keeps each row's real tokens together and in order.
    packed_index = mask.flatten().long().cumsum(0).view_as(mask) - 1  # (batch, seq)
    positions = mask.long().cumsum(dim=1) - 1
    scored = completion_mask.bool()
    target_index = packed_index[:, prompt_ids.size(1) :][scored]
    lengths = mask.sum(dim=1)
    cu_seq_lens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    return PackedSequences(
        input_ids=ids[mask].unsqueeze(0),
        position_ids=positions[mask].unsqueeze(0),
        score_index=target_index - 1,
        targets=completion_ids[scored],
        completion_mask=scored,
        cu_seq_lens=cu_seq_lens,
        max_length=int(lengths.max()),
    )


def require_prompt_tokens(every_row_has_one: bool) -> None:
    """Raise ValueError unless every row to be packed has a prompt token: its first completion
    token is predicted by the hidden state of the token before it."""
    if not every_row_has_one:
        raise ValueError("Every sequence needs at least one prompt token to be packed; got an empty prompt.")


def unpack(values: Tensor, packed: PackedSequences) -> Tensor:
    """`(scored,)` per-token values -> `(batch, completion_len)`, zeros on padding; keeps the grad."""
    out = values.new_zeros(packed.completion_mask.shape)
    return out.index_put((packed.completion_mask,), values)


def token_budget_batches(lengths: Sequence[int], max_tokens: int, min_batches: int = 1) -> list[range]:
    """Split sequences, in order, into consecutive micro-batches of at most `max_tokens` tokens.

    Each micro-batch takes sequences while their summed length fits the budget; a sequence longer
    than the budget gets a micro-batch of its own. Then, while there are fewer than `min_batches`
    (so that every rank runs as many forward passes as the busiest), the micro-batch with the most
    tokens among those of two or more sequences is split in two of near-equal tokens.

    Args:
        lengths: tokens of each sequence (prompt and completion, no padding).
        max_tokens: the budget per micro-batch.
        min_batches: at least this many micro-batches; at most `len(lengths)`.

    Returns:
        Ranges of sequence indices, covering `range(len(lengths))` once, in order.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}.")
    if not 1 <= min_batches <= max(1, len(lengths)):
        raise ValueError(f"min_batches must be in [1, {max(1, len(lengths))}], got {min_batches}.")
    batches: list[range] = []
    start, used = 0, 0
    for index, length in enumerate(lengths):
        if index > start and used + length > max_tokens:
            batches.append(range(start, index))
            start, used = index, 0
        used += length
    if len(lengths):
        batches.append(range(start, len(lengths)))
    while len(batches) < min(min_batches, len(lengths)):
        batches = _split_largest(batches, lengths)
    return batches


def _split_largest(batches: list[range], lengths: Sequence[int]) -> list[range]:
    """Split the micro-batch of most tokens (of two or more sequences) where its halves balance."""
    splittable = [i for i, batch in enumerate(batches) if len(batch) > 1]
    position = max(splittable, key=lambda i: sum(lengths[j] for j in batches[i]))
    batch = batches[position]
    total, running, cut = sum(lengths[j] for j in batch), 0, batch.start + 1
    for index in batch[:-1]:
        running += lengths[index]
        cut = index + 1
        if 2 * running >= total:
            break
    return [*batches[:position], range(batch.start, cut), range(cut, batch.stop), *batches[position + 1 :]]
