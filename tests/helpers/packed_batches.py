"""A padded batch of very different lengths, for packed-against-padded tests."""

from __future__ import annotations

import torch

VOCAB = 40
PROMPT_LENGTHS = [1, 9, 4, 6]
COMPLETION_LENGTHS = [37, 1, 12, 5]
"""Very different lengths: a one-token prompt, a one-token completion, a long completion."""


def padded_batch(prompt_lengths=PROMPT_LENGTHS, completion_lengths=COMPLETION_LENGTHS, device="cpu"):
    """Prompts left-padded and completions right-padded, padding filled with a real token id so that
    a leak through the masks would show: (prompt_ids, prompt_mask, completion_ids, completion_mask)."""
    generator = torch.Generator().manual_seed(0)
    batch, prompt_len, completion_len = len(prompt_lengths), max(prompt_lengths), max(completion_lengths)
    prompt_ids = torch.randint(3, VOCAB, (batch, prompt_len), generator=generator)
    completion_ids = torch.randint(3, VOCAB, (batch, completion_len), generator=generator)
    prompt_mask = torch.zeros(batch, prompt_len, dtype=torch.long)
    completion_mask = torch.zeros(batch, completion_len, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt_mask[row, prompt_len - p :] = 1
        completion_mask[row, :c] = 1
    return tuple(t.to(device) for t in (prompt_ids, prompt_mask, completion_ids, completion_mask))
