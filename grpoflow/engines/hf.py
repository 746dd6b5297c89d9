"""Reference rollout engine on transformers' `generate`.

Slow but exact and universal: it runs any causal LM, generating from the policy module itself
(no weight copy). Sampling log-probs come from one extra forward pass over the finished
sequences, taken on logits divided by the temperature, as the trainer takes them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch

from grpoflow.algo import LogprobOptions, sequence_logprobs
from grpoflow.engines.base import Completion, EngineCapabilities, EngineOptions, EngineStats, SamplingParams


class HFEngine:
    """Generates with `model.generate` on the live policy module."""

    capabilities: EngineCapabilities
    shares_policy_weights = holds_base = True

    def __init__(self, model: torch.nn.Module, tokenizer, *, logprob_chunk_size: int = 4096) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.capabilities = EngineCapabilities(name="hf", module=model)
        self.logprob_chunk_size = logprob_chunk_size
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.policy_version = 0
        self.stats = EngineStats()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty: give at least one token")
        if not prompts:
            self.stats = EngineStats()
            return []
        start = time.perf_counter()
        repeated = [list(prompt) for prompt in prompts for _ in range(params.n)]
        input_ids, attention_mask = left_pad(repeated, self.pad_token_id, self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), _seeded(params.seed, self.device):
                sequences = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    **self._generate_kwargs(params),
                )
            completion_ids = sequences[:, input_ids.shape[1] :]
            rows = [self._trim(row.tolist(), params) for row in completion_ids]
            logprobs = self._logprobs(input_ids, attention_mask, rows, params)
        finally:
            self.model.train(was_training)
        completions = [
            Completion(
                token_ids=ids,
                logprobs=row_logprobs,
                finish_reason=reason,
                policy_version=self.policy_version,
            )
            for (ids, reason), row_logprobs in zip(rows, logprobs)
        ]
        self.stats = EngineStats(
            num_prompt_tokens=sum(map(len, repeated)),
            num_generated_tokens=sum(len(ids) for ids, _ in rows),
            seconds=time.perf_counter() - start,
        )
        return [completions[i : i + params.n] for i in range(0, len(completions), params.n)]

    def _generate_kwargs(self, params: SamplingParams) -> dict:
        greedy = params.temperature == 0
        kwargs = dict(
            max_new_tokens=params.max_tokens,
            do_sample=not greedy,
            pad_token_id=self.pad_token_id,
            eos_token_id=None if params.ignore_eos else list(params.stop_token_ids) or None,
            repetition_penalty=params.repetition_penalty,
            top_k=None,
            top_p=None,
        )
        if params.ignore_eos:
            kwargs["min_new_tokens"] = params.max_tokens
        if not greedy:
            kwargs.update(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else None,
                min_p=params.min_p or None,
            )
        if params.stop:
            kwargs.update(stop_strings=list(params.stop), tokenizer=self.tokenizer)
        return kwargs

    def _trim(self, ids: list[int], params: SamplingParams) -> tuple[list[int], str]:
        """Cut a completion after the token that ended it and say why it ended.

        `generate` pads a row that ends before the others only when it has stop tokens, and lets it
        sample on otherwise, so the end is found from the tokens: the first stop token, or the
        first token that completes a stop string, whichever comes first.
        """
        stop_ids = set() if params.ignore_eos else set(params.stop_token_ids)
        end = next((position + 1 for position, token in enumerate(ids) if token in stop_ids), None)
        if params.stop:
            end = self._stop_string_end(ids[:end], params.stop) or end
        if end is not None:
            return ids[:end], "stop"
        if len(ids) < params.max_tokens:  # every row ended early: what follows the text is padding
            while ids and ids[-1] == self.pad_token_id:
                ids = ids[:-1]
            return ids, "stop"
        return ids, "length"

    def _stop_string_end(self, ids: list[int], stop: Sequence[str]) -> int | None:
        """Length of the shortest prefix of `ids` whose text holds a stop string, or None."""

        def holds(length: int) -> bool:
            text = self.tokenizer.decode(ids[:length], skip_special_tokens=True)
            return any(string in text for string in stop)

        if not ids or not holds(len(ids)):
            return None
        low, high = 1, len(ids)  # binary search: a prefix holding one keeps it when it grows
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if holds(middle) else (middle + 1, high)
        return low

    def _logprobs(self, input_ids, attention_mask, rows, params) -> list[list[float]]:
        width = max((len(ids) for ids, _ in rows), default=0)
        if width == 0:
            return [[] for _ in rows]
        completion = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        completion_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, (ids, _) in enumerate(rows):
            completion[row, : len(ids)] = torch.tensor(ids)
            completion_mask[row, : len(ids)] = 1
        device = input_ids.device
        full_ids = torch.cat([input_ids, completion.to(device)], dim=1)
        full_mask = torch.cat([attention_mask, completion_mask.to(device)], dim=1)
        with torch.no_grad():
            logps, _ = sequence_logprobs(
                self.model,
                full_ids,
                full_mask,
                logits_to_keep=width,
                options=LogprobOptions(
                    temperature=params.temperature or 1.0,
                    chunk_size=self.logprob_chunk_size,
                    truncation=params.truncation if params.temperature > 0 else None,
                ),
            )
        return [logps[row, : len(ids)].tolist() for row, (ids, _) in enumerate(rows)]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """The engine runs the policy module itself: only foreign weights need copying."""
        own = dict(self.model.named_parameters(remove_duplicate=False))  # tied names too
        with torch.no_grad():
            for name, tensor in weights:
                if name not in own:
                    raise ValueError(f"update_weights: the model has no parameter named {name!r}")
                if own[name].data_ptr() != tensor.data_ptr():
                    own[name].copy_(tensor)
        self.policy_version = version

    def sleep(self, level: int = 1) -> None:
        """Nothing persists between calls of `generate`: what a call used is back with the
        process's caching allocator, where a training run's update takes it (`grpoflow serve`'s
        /sleep hands it to the driver for other processes)."""

    def wake_up(self) -> None:
        return None

    def reset_prefix_cache(self) -> None:
        """No prefix outlives a call."""

    def close(self) -> None:
        """Nothing outlives a call."""


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, longest) ids and attention mask with the padding on the left."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        if row:
            ids[index, width - len(row) :] = torch.as_tensor(row)
            mask[index, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


@contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Seed the global generators for one call and restore them afterwards (no-op without a seed)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def build(model: torch.nn.Module, tokenizer, options: EngineOptions) -> HFEngine:
    """Registry factory."""
    return HFEngine(model, tokenizer, logprob_chunk_size=options.logprob_chunk_size)
