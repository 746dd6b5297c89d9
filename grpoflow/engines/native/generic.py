"""The generic path: any causal LM, run as its own transformers module with its own cache.

Slower than the family path (no paged cache, no graphs, no prompt sharing: each sequence is its
own row, prompts left-padded, finished rows kept until the chunk ends), but it samples with the
same sampler and stops by the same rules, so every model gets the same engine semantics.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from grpoflow.engines.native.requests import Abandoned, RequestBook
from grpoflow.engines.native.sampler import SamplingOptions, sample


class GenericRunner:
    """Generates chunks of up to `max_rows` sequences with `model(...)` and a DynamicCache."""

    def __init__(self, model: nn.Module, max_rows: int, use_triton: bool) -> None:
        self.model, self.max_rows, self.use_triton = model, max_rows, use_triton

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def run(
        self, book: RequestBook, options: SamplingOptions, abandoned: Abandoned, joins: Callable
    ) -> dict[str, float]:
        """Generate every sequence of `book`; those of the prompts `abandoned()` names (asked
        between steps) stop where they stand. A chunk takes the prompts' waiting samples in turn;
        `joins()`, called between chunks, adds requests to the book and hands finished ones over."""
        steps, started = 0, np.zeros(0, dtype=bool)
        while True:
            joins()
            started = np.concatenate([started, np.zeros(book.num_sequences - len(started), dtype=bool)])
            waiting = np.nonzero(~started)[0]
            if not len(waiting):
                break
            book.abort(abandoned())
            sample = waiting - np.asarray(book.first_sequence)[book.prompt_of[waiting]]
            chunk = np.sort(waiting[np.argsort(sample, kind="stable")][: self.max_rows])  # prompts in turn
            started[chunk] = True
            if not book.done[chunk].all():
                steps += self._run_chunk(book, chunk, options, abandoned)
        return {"decode_steps": float(steps), "prefill_steps": float(-(-book.num_sequences // self.max_rows))}

    def _run_chunk(
        self, book: RequestBook, chunk: np.ndarray, options: SamplingOptions, abandoned: Abandoned
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
