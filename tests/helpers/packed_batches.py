"""Padded batches for packed-against-padded tests: one of very different lengths, one of groups of
rows sharing their prompts."""

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


def grouped_batch(device="cpu"):
    """Three groups: rows 0-2 share a full prompt (row 2's completion empty), rows 3-5 a
    left-padded one (row 4's completion one token), row 6 alone; padding filled with real ids."""
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, VOCAB, (7, 6), generator=generator)
    prompt_ids[1:3] = prompt_ids[0]
    prompt_ids[4:6] = prompt_ids[3]
    prompt_mask = torch.ones(7, 6, dtype=torch.long)
    prompt_mask[3:6, :2] = 0
    prompt_mask[6, :4] = 0
    completion_ids = torch.randint(3, VOCAB, (7, 9), generator=generator)
    completion_mask = torch.zeros(7, 9, dtype=torch.long)
    for row, length in enumerate([9, 4, 0, 7, 1, 9, 3]):
        completion_mask[row, :length] = 1
    return tuple(t.to(device) for t in (prompt_ids, prompt_mask, completion_ids, completion_mask))
