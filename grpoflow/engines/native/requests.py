"""The sequences of one `generate` call: what each has generated, and when it must stop.

Arrays are indexed by sequence id (prompt-major: the `n` samples of prompt 0, then of prompt 1,
..., then those of requests that joined the running call, `extend`), so recording a decode step
and testing stop tokens and lengths are a few numpy operations whatever the batch size; only stop
strings need per-sequence work.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np

from grpoflow.algo.draws import row_keys, sequence_seeds
from grpoflow.engines.base import Completion, SamplingParams
from grpoflow.engines.native.routing import RoutingRecord

Abandoned = Callable[[], Collection[int]]
"""Indices of the prompts of a call whose completions nobody waits for any more."""


class RequestBook:
    """Per-sequence state of one call. Prompts marked invalid get no sequences."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        errors: Sequence[str | None],
        *,
        seed: int,
        max_model_len: int,
        tokenizer=None,
    ) -> None:
        self.prompts = [list(map(int, prompt)) for prompt in prompts]
        self.params, self.errors, self.tokenizer = list(params), list(errors), tokenizer
        self.first_sequence: list[int] = []
        prompt_of, sample_of, limit = [], [], []
        for index, (prompt, request) in enumerate(zip(self.prompts, self.params)):
            self.first_sequence.append(len(prompt_of))
            if errors[index] is not None:
                continue
            prompt_of += [index] * request.n
            sample_of += range(request.sample_offset, request.sample_offset + request.n)
            limit += [min(request.max_tokens, max_model_len - len(prompt))] * request.n
        self.prompt_of = np.array(prompt_of, dtype=np.int64)
        self.sample_of = np.array(sample_of, dtype=np.int64)
        self.limit = np.array(limit, dtype=np.int64)
        num_sequences = len(prompt_of)
        width = int(self.limit.max()) if num_sequences else 1
        self.tokens = np.zeros((num_sequences, width), dtype=np.int64)
        self.logprobs = np.zeros((num_sequences, width), dtype=np.float32)
        self.num_generated = np.zeros(num_sequences, dtype=np.int64)
        self.done = np.zeros(num_sequences, dtype=bool)
        self.finish_reason: list[str] = ["length"] * num_sequences
        self.seeds = self._seeds(seed)
        offsets = np.array([request.token_offset for request in self.params] + [0], dtype=np.int64)
        self.token_offsets = offsets[self.prompt_of]
        self.stop_ids = self._stop_id_table()
        self.stop_strings = [tuple(request.stop) for request in self.params]
        self._converted: tuple[list, list, list[int]] | None = None  # see convert_ahead
        self.routing: RoutingRecord | None = None  # the experts chosen, when they are recorded
        if any(self.stop_strings) and tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to NativeEngine")

    def _seeds(self, call_seed: int) -> np.ndarray:
        """A request with a seed gets streams that depend on (seed, sample index) only; one without
        gets streams from the call's seed and its prompt index too."""
        seeded = np.array([request.seed is not None for request in self.params] + [False], dtype=bool)
        request_seeds = np.array([request.seed or 0 for request in self.params] + [0], dtype=np.int64)
        own, own_seed = seeded[self.prompt_of], request_seeds[self.prompt_of]
        seeds = sequence_seeds(call_seed, self.prompt_of, self.sample_of)
        for seed in np.unique(own_seed[own]).tolist():
            chosen = own & (own_seed == seed)
            seeds[chosen] = sequence_seeds(
                seed, np.zeros(int(chosen.sum()), dtype=np.int64), self.sample_of[chosen]
            )
        return seeds

    def _stop_id_table(self) -> np.ndarray:
        """(S, K) stop token ids per sequence, -1 padded; empty rows under ignore_eos."""
        width = max([len(request.stop_token_ids) for request in self.params] + [1])
        table = np.full((len(self.prompt_of), width), -1, dtype=np.int64)
        for index, request in enumerate(self.params):
            if request.ignore_eos or not request.stop_token_ids:
                continue
            rows = self.prompt_of == index
            table[rows, : len(request.stop_token_ids)] = list(request.stop_token_ids)
        return table

    def extend(self, other: RequestBook) -> range:
        """Add the prompts and sequences of `other` (a request that joins the call) after these;
        returns their prompts' indices here."""
        first_prompt, first = len(self.prompts), self.num_sequences
        for name in ("prompts", "params", "errors", "stop_strings", "finish_reason"):
            getattr(self, name).extend(getattr(other, name))
        self.first_sequence += [first + sequence for sequence in other.first_sequence]
        for name in ("prompt_of", "sample_of", "limit", "num_generated", "done", "seeds", "token_offsets"):
            setattr(self, name, np.concatenate([getattr(self, name), getattr(other, name)]))
        self.prompt_of[first:] += first_prompt
        for name, fill in (("tokens", 0), ("logprobs", 0), ("stop_ids", -1)):
            pair = [getattr(self, name), getattr(other, name)]
            width = max(part.shape[1] for part in pair)
            pair = [np.pad(part, ((0, 0), (0, width - part.shape[1])), constant_values=fill) for part in pair]
            setattr(self, name, np.concatenate(pair))
        return range(first_prompt, len(self.prompts))

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_of)

    @property
    def finished(self) -> bool:
        return bool(self.done.all())

    def abort(self, prompts: Collection[int]) -> np.ndarray:
        """Stop every unfinished sequence of `prompts` where it stands (finish_reason 'abort');
        returns their ids."""
        if not len(prompts) or not self.num_sequences:
            return np.zeros(0, dtype=np.int64)
        chosen = np.isin(self.prompt_of, np.fromiter(prompts, dtype=np.int64)) & ~self.done
        sequences = np.nonzero(chosen)[0]
        self.done[sequences] = True
        for sequence in sequences.tolist():
            self.finish_reason[sequence] = "abort"
        return sequences

    def sequences_of(self, prompts: range) -> slice:
        """The ids of the sequences of `prompts`."""
        ends = (prompts.start, prompts.stop)
        return slice(*(self.first_sequence[i] if i < len(self.prompts) else self.num_sequences for i in ends))

    def sequence_tokens(self, sequence: int) -> list[int]:
        """Prompt plus what has been generated so far."""
        generated = self.tokens[sequence, : self.num_generated[sequence]].tolist()
        return self.prompts[self.prompt_of[sequence]] + generated

    def keys(self, sequences: np.ndarray, token_index: np.ndarray | None = None) -> np.ndarray:
        """Sampling keys (int64) for token `token_index` (default: the next) of each sequence."""
        if token_index is None:
            token_index = self.num_generated[sequences]
        return row_keys(self.seeds[sequences], token_index + self.token_offsets[sequences])

    def record(self, sequences: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> np.ndarray:
        """Append one sampled token per sequence; returns the ids of sequences that finished."""
        position = self.num_generated[sequences]
        self.tokens[sequences, position] = tokens
        self.logprobs[sequences, position] = logprobs
        self.num_generated[sequences] = position + 1
        stopped = (self.stop_ids[sequences] == tokens[:, None]).any(axis=1)
        if any(self.stop_strings):
            stopped |= self._hit_stop_string(sequences)
        finished = stopped | (position + 1 >= self.limit[sequences])
        ended = sequences[finished]
        self.done[ended] = True
        for sequence in sequences[stopped]:
            self.finish_reason[sequence] = "stop"
        return ended

    def _hit_stop_string(self, sequences: np.ndarray) -> np.ndarray:
        hits = np.zeros(len(sequences), dtype=bool)
        for row, sequence in enumerate(sequences):
            strings = self.stop_strings[self.prompt_of[sequence]]
            if not strings:
                continue
            count = self.num_generated[sequence]
            window = max(map(len, strings)) + 8
            tail = self.tokenizer.decode(self.tokens[sequence, max(0, count - window) : count].tolist())
            hits[row] = any(string in tail for string in strings)
        return hits

    def convert_ahead(self) -> None:
        """Turn what has been generated so far into Python lists now (while the GPU finishes the
        last steps), so that `completions` only converts the tokens recorded after this."""
        self._converted = (self.tokens.tolist(), self.logprobs.tolist(), self.num_generated.tolist())

    def completions(self, policy_version: int, prompts: range | None = None) -> list[list[Completion]]:
        """One list of `n` completions per prompt (of `prompts`, default all); an invalid prompt's
        completions are empty with finish_reason 'error'."""
        prompts = range(len(self.params)) if prompts is None else prompts
        rows, converted = self.sequences_of(prompts), self._converted
        counts = self.num_generated[rows].tolist()
        if converted is None:  # whole arrays at once: faster than row by row
            converted = (self.tokens[rows].tolist(), self.logprobs[rows].tolist(), counts)
        base = 0 if self._converted else rows.start
        tokens, logprobs, ahead = converted
        result = []
        for index in prompts:
            request = self.params[index]
            if self.errors[index] is not None:
                error = Completion([], [], "error", policy_version, text=self.errors[index])
                result.append([error] * request.n)
                continue
            group = []
            for sequence in range(self.first_sequence[index], self.first_sequence[index] + request.n):
                count, start = counts[sequence - rows.start], ahead[sequence - base]
                row_tokens, row_logprobs = tokens[sequence - base], logprobs[sequence - base]
                if count > start:  # converted ahead, and grown since
                    row_tokens = row_tokens[:start] + self.tokens[sequence, start:count].tolist()
                    row_logprobs = row_logprobs[:start] + self.logprobs[sequence, start:count].tolist()
                elif count < len(row_tokens):
                    row_tokens, row_logprobs = row_tokens[:count], row_logprobs[:count]
                group.append(self._completion(sequence, row_tokens, row_logprobs, policy_version))
            result.append(group)
        return result

    def _completion(
        self, sequence: int, token_ids: list[int], logprobs: list[float], policy_version: int
    ) -> Completion:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            for string in self.stop_strings[self.prompt_of[sequence]]:
                if string in text:
                    text = text[: text.index(string)]
        routed = None
        if self.routing is not None:
            length = len(self.prompts[self.prompt_of[sequence]]) + len(token_ids)
            routed = self.routing.of(sequence, length, len(token_ids))
        return Completion(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=self.finish_reason[sequence],
            policy_version=policy_version,
            text=text,
            routed_experts=routed,
        )
