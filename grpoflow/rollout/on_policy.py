"""Sampling that is on-policy by construction (`on_policy_sampling`): every completion token is
an exact draw from the trainer's own forward, and its log-prob is the trainer's.

The native engine draws each token by Gumbel-max with keyed noise (`grpoflow.algo.draws`) from
logits that its decode kernels compute, which round differently from the training forward. Here the trainer
replays every draw with the same key on its own logits of the same prefix
(`grpoflow.algo.redraw`). Up to the first disagreement the engine's tokens are the trainer's
draws; at the first disagreement the trainer's token replaces the engine's, and the engine
continues the completion from there with the same key stream (`SamplingParams.sample_offset`,
`token_offset`), which the next round checks in turn. A completion is done when the trainer's
replay agrees with every token, so each token is the draw of the trainer's distribution at its key,
as if the trainer had sampled it itself; the engine only proposes.

Rounds after the first check only the completions that changed. Whenever anything changed, a
last pass replays every completion in the rows and padding of the update's micro-batches, whose
log-probs then are those the update computes from the same hidden states; a disagreement there
(the forward's rounding depends on the batch's shape) starts another round. A completion still
changing after `MAX_ROUNDS` keeps its unchecked tail (counted in `on_policy/unchecked_tokens`).

With `batch_invariant` the engine's forward and the trainer's run on the same batch-invariant
kernels (`grpoflow.policy.batch_invariant`), so the engine's logits are the trainer's and the first
replay agrees with every draw: one round. `on_policy_check: update` then skips the replay and
checks every token's log-prob in the update instead (`grpoflow.algo.exact_draw_weights`).

Under `fsdp` the native engine generates from the gathered policy (`Placement.rollout_context`),
and the replay's forward passes inside it are each rank's own: every rank settles its own
completions. Where a replay forward all-gathers parameters (a sharded policy outside
`full_parameters`), the ranks agree each round on whether any of them still replays and on the
most micro-batches any replays (`Replay.agreed_forwards`); a rank with fewer runs the others on a
row of padding, so that every rank runs the same forward passes and rounds.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from grpoflow.algo.draws import row_keys, sequence_seeds
from grpoflow.algo.redraw import sequence_redraws
from grpoflow.algo.truncation import Truncation
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion, RolloutEngine, SamplingParams, prefix_cache_metrics
from grpoflow.policy.placement import Placement
from grpoflow.rollout.batch import collate_pairs
from grpoflow.rollout.groups import Group

MAX_ROUNDS = 32
"""Rounds of replay and continuation before a completion keeps its unchecked tail."""
CONTINUE = "continue"
"""The finish reason of a draft the engine must continue."""


@dataclass(slots=True)
class _Draft:
    """One completion being made on-policy."""

    prompt: list[int]
    params: SamplingParams
    sample: int
    seed: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    checked: int = 0
    """Leading tokens the trainer's replay has confirmed."""
    policy_version: int = 0
    distributions: dict | None = None
    """The engine's kept distributions by position, of the prefixes the draft still has."""

    @property
    def done(self) -> bool:
        return self.checked >= len(self.tokens)

    def completion(self) -> Completion:
        return Completion(
            list(self.tokens),
            list(self.logprobs),
            self.finish_reason,
            self.policy_version,
            distributions=self.distributions or None,
        )


@dataclass(slots=True)
class Replay:
    """How the trainer replays draws: its placed policy, the distribution the engine drew from
    (temperature, replayed truncation) and the rows the update gives the completions."""

    placement: Placement
    micro_batch_size: int
    temperature: float
    truncation: Truncation | None = None
    chunk_size: int = 1024
    pad_id: int = 0

    def redraw(self, pairs: Sequence[tuple[Sequence[int], Completion]], keys: np.ndarray) -> tuple:
        """(rows, width) trainer draws and log-probs of one micro-batch of `(prompt, completion)`
        pairs, in the rows and padding the update gives them (`collate`, then `RolloutBatch.rows`);
        `keys`: (rows, width) int64 keys of the completion tokens' draws."""
        batch = collate_pairs(pairs, self.pad_id, self.placement.device)
        batch = batch.rows(0, len(batch))
        input_ids, mask = batch.model_inputs()
        keys = torch.from_numpy(keys[:, : batch.completion_ids.shape[1]]).to(input_ids.device)
        model = self.placement.module
        with self.placement.evaluating():
            return self.placement.sharded_forward(
                lambda: sequence_redraws(
                    model, input_ids, mask, keys, self.temperature, self.truncation, self.chunk_size
                )
            )

    def agreed_forwards(self, drafts: int) -> int | None:
        """Where a forward pass is a collective (`Placement.forward_is_collective`), the most
        micro-batches any rank replays this round, this one replaying `drafts` completions (a
        collective itself); None where each rank's forward passes are its own."""
        if not self.placement.forward_is_collective:
            return None
        return self.placement.max_over_ranks(math.ceil(drafts / self.micro_batch_size))

    def run_idle(self, agreed: int | None, drafts: int) -> None:
        """The forward passes that a rank which replayed `drafts` completions lacks of the `agreed`
        number (`agreed_forwards`), each on one row of padding whose draws nothing reads."""
        for _ in range((agreed or 0) - math.ceil(drafts / self.micro_batch_size)):
            padding = Completion([self.pad_id], [0.0], "stop")
            self.redraw([([self.pad_id], padding)], np.zeros((1, 1), dtype=np.int64))


@dataclass(slots=True)
class OnPolicyDraws:
    """Completions of the engine's that the trainer's forward redraws until every token is its
    own draw (see the module docstring); `counts` sums the work over calls. Where the replay's
    forward passes are collectives, every rank calls `generate` as often as the others."""

    tokenizer: object
    replay: Replay
    counts: dict[str, int] = field(default_factory=dict)
    prefill: dict[str, float] = field(default_factory=dict)
    """The engine's prefill and prefix-cache counts of the last call's first sampling."""

    def generate(
        self, engine: RolloutEngine, prompts: Sequence[Sequence[int]], params: SamplingParams | list
    ) -> list[list[Completion]]:
        """`engine.generate`'s completions, each token an exact draw of the trainer's forward."""
        requests = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        requests = [dataclasses.replace(request, draw="gumbel") for request in requests]
        outputs = engine.generate(prompts, requests)
        self.prefill = prefix_cache_metrics(engine.stats.prefill)
        drafts = [
            [_draft(prompt, request, sample, completion) for sample, completion in enumerate(completions)]
            for prompt, request, completions in zip(prompts, requests, outputs, strict=True)
        ]
        for name, value in self._settle(engine, drafts).items():
            self.counts[name] = self.counts.get(name, 0) + value
        return [
            [
                draft.completion() if draft.finish_reason != "error" else completion
                for draft, completion in zip(members, completions)
            ]
            for members, completions in zip(drafts, outputs)
        ]

    def metrics(self) -> dict[str, float]:
        """`on_policy/NAME` of each count, then the counts start again."""
        metrics = {f"on_policy/{name}": float(value) for name, value in self.counts.items()}
        self.counts = {}
        return metrics

    def _settle(self, engine: RolloutEngine, drafts: list[list[_Draft]]) -> dict[str, int]:
        everyone = [draft for members in drafts for draft in members if draft.finish_reason != "error"]
        counts = {"rounds": 0, "replaced_tokens": 0, "continued_tokens": 0, "unchecked_tokens": 0}
        pending, full_pass = everyone, True
        while counts["rounds"] < MAX_ROUNDS:
            forwards = self.replay.agreed_forwards(len(pending))
            if forwards == 0:  # every rank has settled
                return counts
            counts["rounds"] += 1
            changed = self._replay(pending, forwards)
            if not changed and full_pass:
                if forwards is None:
                    return counts
                pending = []  # settled: padding forward passes while another rank replays
                continue
            counts["replaced_tokens"] += len(changed)
            self._continue(engine, [draft for draft in changed if draft.finish_reason == CONTINUE], counts)
            pending = [draft for draft in everyone if not draft.done]
            full_pass = not pending
            if full_pass:  # every change is checked: confirm them all in the update's layout
                for draft in everyone:
                    draft.checked = 0
                pending = everyone
        counts["unchecked_tokens"] = sum(len(draft.tokens) - draft.checked for draft in everyone)
        return counts

    def _replay(self, drafts: list[_Draft], forwards: int | None = None) -> list[_Draft]:
        """Replay the drafts' draws on the trainer's forward, micro-batch by micro-batch in their
        order (then padding ones up to the ranks' agreed `forwards`); cut each at its first
        disagreement and put the trainer's token there. Returns the drafts that changed."""
        changed = []
        for start in range(0, len(drafts), self.replay.micro_batch_size):
            part = drafts[start : start + self.replay.micro_batch_size]
            seeds = np.array([draft.seed for draft in part], dtype=np.uint64)
            width = max(len(draft.tokens) for draft in part)
            keys = row_keys(seeds[:, None], np.arange(width)[None, :])
            tokens, logprobs = self.replay.redraw(
                [(draft.prompt, draft.completion()) for draft in part], keys
            )
            for row, draft in enumerate(part):
                length = len(draft.tokens)
                ours = tokens[row, :length].tolist()
                draft.logprobs = logprobs[row, :length].tolist()
                first = next((t for t in range(draft.checked, length) if ours[t] != draft.tokens[t]), None)
                if first is None:
                    draft.checked = length
                    continue
                if draft.distributions:  # later positions had another prefix
                    draft.distributions = {p: row for p, row in draft.distributions.items() if p <= first}
                draft.tokens = draft.tokens[:first] + [ours[first]]
                draft.logprobs = draft.logprobs[: first + 1]
                draft.checked = first + 1
                draft.finish_reason = self._finish(draft)
                changed.append(draft)
        self.replay.run_idle(forwards, len(drafts))
        return changed

    def _finish(self, draft: _Draft) -> str:
        """How a completion whose last token the trainer just drew ends: 'stop', 'length', or
        'continue' when the engine must go on."""
        params = draft.params
        if not params.ignore_eos and draft.tokens[-1] in set(params.stop_token_ids):
            return "stop"
        if params.stop:
            tail = self.tokenizer.decode(draft.tokens[-(max(map(len, params.stop)) + 8) :])
            if any(string in tail for string in params.stop):
                return "stop"
        if len(draft.tokens) >= params.max_tokens:
            return "length"
        return CONTINUE

    def _continue(self, engine: RolloutEngine, drafts: list[_Draft], counts: dict[str, int]) -> None:
        """The engine continues each draft past its last token, on the same key stream."""
        if not drafts:
            return
        requests = [
            dataclasses.replace(
                draft.params,
                n=1,
                sample_offset=draft.sample,
                token_offset=len(draft.tokens),
                max_tokens=draft.params.max_tokens - len(draft.tokens),
            )
            for draft in drafts
        ]
        outputs = engine.generate([draft.prompt + draft.tokens for draft in drafts], requests)
        for draft, (completion,) in zip(drafts, outputs, strict=True):
            if completion.finish_reason == "error":  # no room left in the model's context
                draft.finish_reason = "length"
                continue
            offset = len(draft.tokens)
            draft.distributions = {
                **(draft.distributions or {}),
                **{offset + p: row for p, row in (completion.distributions or {}).items()},
            }
            draft.tokens += completion.token_ids
            draft.logprobs += completion.logprobs
            draft.finish_reason = completion.finish_reason
            counts["continued_tokens"] += len(completion.token_ids)


@dataclass(slots=True)
class OnPolicySingleTurn:
    """`SingleTurn` whose completions the trainer's forward redraws (see the module docstring)."""

    tokenizer: object
    replay: Replay
    last_metrics: dict[str, float] = field(default_factory=dict)

    def __call__(
        self, engine: RolloutEngine, items: Sequence[PromptItem], params: SamplingParams | list
    ) -> list[Group]:
        start = time.perf_counter()
        draws = OnPolicyDraws(self.tokenizer, self.replay)
        outputs = draws.generate(engine, [item.prompt_ids for item in items], params)
        groups = [
            Group(
                item=item,
                completions=completions,
                texts=[self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions],
            )
            for item, completions in zip(items, outputs, strict=True)
        ]
        self.last_metrics = {
            **draws.prefill,
            **draws.metrics(),
            "on_policy/seconds": time.perf_counter() - start,
        }
        return groups


def pad_id(tokenizer) -> int:
    """The tokenizer's pad id, else 0: what `collate` pads with."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else 0


def _draft(prompt: Sequence[int], params: SamplingParams, sample: int, completion: Completion) -> _Draft:
    if params.seed is None:
        raise ValueError("on_policy_sampling replays seeded draws: give each prompt's SamplingParams a seed")
    seed = int(sequence_seeds(params.seed, np.zeros(1, dtype=np.int64), np.array([sample]))[0])
    return _Draft(
        prompt=list(prompt),
        params=params,
        sample=sample,
        seed=seed,
        tokens=list(completion.token_ids),
        logprobs=list(completion.logprobs),
        finish_reason=completion.finish_reason,
        policy_version=completion.policy_version,
        distributions=completion.distributions,
    )
