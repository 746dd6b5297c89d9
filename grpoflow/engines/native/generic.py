"""The generic path: any causal LM, run as its own transformers module with its own cache.

Slower than the family path (no paged cache, no graphs, no prompt sharing: each sequence is its
own row, prompts left-padded, finished rows kept until the chunk ends), but it samples with the
same sampler and stops by the same rules, so every model gets the same engine semantics.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np
import torch
from torch import nn

from grpoflow.engines.native.requests import RequestBook
from grpoflow.engines.native.sampler import SamplingOptions, sample


class GenericRunner:
    """Generates chunks of up to `max_rows` sequences with `model(...)` and a DynamicCache."""

    def __init__(self, model: nn.Module, max_rows: int, use_triton: bool) -> None:
        self.model, self.max_rows, self.use_triton = model, max_rows, use_triton

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def run(
        self, book: RequestBook, options: SamplingOptions, abandoned: Callable[[], Collection[int]]
    ) -> dict[str, float]:
        """Generate every sequence of `book`; those of the prompts `abandoned()` names (asked
        between steps) stop where they stand."""
        steps = 0
        for first in range(0, book.num_sequences, self.max_rows):
            book.abort(abandoned())
            chunk = np.arange(first, min(first + self.max_rows, book.num_sequences))
            if book.done[chunk].all():
                continue
            steps += self._run_chunk(book, chunk, options, abandoned)
        return {"decode_steps": float(steps), "prefill_steps": float(-(-book.num_sequences // self.max_rows))}

    def _run_chunk(
        self,
        book: RequestBook,
        chunk: np.ndarray,
        options: SamplingOptions,
        abandoned: Callable[[], Collection[int]],
    ) -> int:
        device = self.device
        prompts = [book.prompts[book.prompt_of[sequence]] for sequence in chunk]
        length = max(map(len, prompts))
        ids = torch.zeros(len(prompts), length, dtype=torch.long)
        mask = torch.zeros(len(prompts), length, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, length - len(prompt) :] = torch.tensor(prompt)
            mask[row, length - len(prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        seen = None
        if options.repetition_penalty != 1:
            vocab_size = self.model.get_output_embeddings().weight.shape[0]
            seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool, device=device)
            for row, prompt in enumerate(prompts):
                seen[row, torch.tensor(prompt, device=device)] = True
        output = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        alive = ~book.done[chunk]
        steps = 0
        while True:
            keys = np.zeros(len(chunk), dtype=np.int64)
            keys[alive] = book.keys(chunk[alive])
            logits = output.logits[:, -1]
            tokens, logprobs = sample(
                logits, torch.from_numpy(keys).to(device), options, seen=seen, use_triton=self.use_triton
            )
            ended = book.record(chunk[alive], tokens.cpu().numpy()[alive], logprobs.cpu().numpy()[alive])
            book.abort(abandoned())
            alive &= ~np.isin(chunk, ended) & ~book.done[chunk]
            if not alive.any():
                return steps
            if seen is not None:
                seen[torch.arange(len(chunk), device=device), tokens] = True
            mask = torch.cat((mask, mask.new_ones(len(chunk), 1)), dim=1)
            positions = positions[:, -1:] + 1
            output = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=output.past_key_values,
                use_cache=True,
            )
            steps += 1
