"""The trainer's own draws of completion tokens: the engine's keyed Gumbel-max draws
(`grpoflow.algo.draws.gumbel_draw`) replayed on the training forward's logits.

A native-engine completion drawn with `draw="gumbel"` is a sequence of keyed draws, each from the
engine's logits. Replaying
every draw with the same key on the trainer's logits of the same prefix gives the token the
trainer's distribution puts at that uniform; where the two agree the token is an exact draw from
the trainer's forward. `grpoflow.rollout.on_policy` continues each completion from its first
disagreement, so that every token ends up drawn from the trainer's forward.

The log-probs come from `token_logprobs_from_hidden`, the function the update scores tokens with,
on the same hidden states: they equal the update's wherever its forward computes the same hidden
states (same rows, same padding).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from grpoflow.algo.draws import gumbel_draw
from grpoflow.algo.logprobs import (
    DEFAULT_CHUNK_SIZE,
    completion_hidden,
    decoder_and_head,
    projection,
    token_logprobs_from_hidden,
)
from grpoflow.algo.truncation import Truncation


@torch.no_grad()
def redraw_from_hidden(
    hidden: Tensor,
    head: nn.Module | Tensor,
    keys: Tensor,
    temperature: float,
    truncation: Truncation | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """Keyed Gumbel-max draws from `softmax(head(hidden) / temperature)` (truncated when asked).

    Args:
        hidden: `(batch, seq, hidden)`; position t's state draws token t.
        head: the output projection, an `nn.Linear` or its weight `(vocab, hidden)`.
        keys: `(batch, seq)` int64, the draws' keys (`row_keys`).

    Returns:
        tokens: `(batch, seq)` int64, the token each key draws.
        log_probs: `(batch, seq)` float32, their log-probs as the update computes them.
    """
    project, _ = projection(head, None)
    truncation = truncation if truncation is not None and truncation.active else None
    flat_hidden = hidden.reshape(-1, hidden.size(-1))
    inverse_temperature = 1.0 / temperature  # the sampler's arithmetic on the logits
    pieces = []
    for hidden_chunk, key_chunk in zip(flat_hidden.split(chunk_size), keys.reshape(-1).split(chunk_size)):
        logits = project(hidden_chunk)  # (chunk, vocab), as the update projects
        thresholds = truncation.thresholds(logits.float() * inverse_temperature) if truncation else None
        pieces.append(gumbel_draw(logits, key_chunk, inverse_temperature, thresholds)[0])
    tokens = torch.cat(pieces).view(keys.shape) if pieces else keys.new_zeros(keys.shape)
    log_probs, _ = token_logprobs_from_hidden(
        hidden, head, tokens, temperature, chunk_size, truncation=truncation
    )
    return tokens, log_probs


@torch.no_grad()
def sequence_redraws(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    keys: Tensor,
    temperature: float,
    truncation: Truncation | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """The trainer's keyed draws of the last `keys.shape[1]` tokens of each sequence, from the
    decoder body as `sequence_logprobs` runs it.

    Args:
        input_ids: `(batch, seq)` prompt then completion tokens, prompts left-padded.
        attention_mask: `(batch, seq)`, or None without padding before a completion token.
        keys: `(batch, completion_len)` int64 keys of the completion's draws.

    Returns:
        `(batch, completion_len)` tokens and their log-probs (`redraw_from_hidden`).
    """
    parts = decoder_and_head(model)
    if parts is None:
        raise ValueError(
            f"{type(model).__name__} transforms its logits after the output projection "
            "(soft-capping or scaling): on_policy_sampling cannot replay its draws"
        )
    decoder, head = parts
    hidden = completion_hidden(decoder, input_ids, attention_mask, keys.shape[1])
    return redraw_from_hidden(hidden, head, keys, temperature, truncation, chunk_size)
