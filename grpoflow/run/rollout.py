"""Rollouts: prompts to groups of completions, and groups to padded training tensors.

A `Rollout` is what the trainer calls to turn a step's prompts into groups: `SingleTurn` samples
one completion per member, `Episodes` plays multi-turn episodes (`grpoflow.agents`). Other ways of
producing groups implement the same protocol: `grpoflow.run.rollout_func` plays a user's
rollout function (TRL's `rollout_func`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

import torch

from grpoflow.algo import select_groups
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion, RolloutEngine, SamplingParams, prefill_stats, prefix_cache_metrics


@dataclass(slots=True)
class Group:
    """One prompt and its G completions (or episodes)."""

    item: PromptItem
    completions: list[Completion]
    texts: list[str]
    conversations: list[list[dict]] | None = None
    """Per completion of an episode: its turns as messages (assistant, tool, user)."""
    environments: list[Any] | None = None
    """Per completion of an episode: its environment instance."""
    extra_columns: dict[str, list[Any]] | None = None
    """Columns the rollout made, one value per completion (a rollout function's extra keys);
    reward functions receive them beside the row's columns, which they override."""
    sampling_logprobs: bool = True
    """Whether the completions carry the engine's log-probs (a rollout function may not)."""


@dataclass(slots=True)
class ScoredGroups:
    """Groups of completions and their rewards, (num_completions, num_rewards) with NaN missing."""

    groups: list[Group]
    rewards: torch.Tensor
    errors: list = field(default_factory=list)
    rounds: int = 1
    failed_everywhere: frozenset[str] = frozenset()
    """Reward functions that failed on every sample scored for these groups."""
    group_sizes: list[int] | None = None
    """Each group's number of completions when they differ; None: num_generations each."""
    zero_advantage: torch.Tensor | None = None
    """(num_completions,) bool: completions that train with advantage 0 whatever their reward."""
    sampling_logprobs: bool = True
    """Whether the completions carry their sampling log-probs (the importance-sampling
    correction needs them)."""

    def oldest_version(self) -> int:
        """The oldest policy version that sampled one of the completions."""
        return min(c.policy_version for group in self.groups for c in group.completions)


class ScoredBatches(Protocol):
    """Where a run's scored groups come from when it does not sample and score them itself
    (`grpoflow.run.atropos_batches`)."""

    reward_names: Sequence[str]
    """The reward columns of its batches."""
    policy_version: int
    """Set by the trainer before each `next`: its current step."""

    def next(self) -> ScoredGroups:
        """The next step's groups, scored."""
        ...

    def close(self) -> None: ...


class Rollout(Protocol):
    """Turns a step's prompt items into groups of `params.n` scored-to-be completions."""

    last_metrics: dict[str, float]
    """Metrics of the last call (e.g. turns per episode), logged with the step's."""

    def __call__(
        self, engine: RolloutEngine, items: Sequence[PromptItem], params: SamplingParams | list
    ) -> list[Group]: ...


@dataclass(slots=True)
class SingleTurn:
    """One completion per group member, sampled in one engine call; its metrics are the engine's
    prefill and prefix-cache counts, when the engine keeps them."""

    tokenizer: Any
    last_metrics: dict[str, float] = field(default_factory=dict)

    def __call__(
        self, engine: RolloutEngine, items: Sequence[PromptItem], params: SamplingParams | list
    ) -> list[Group]:
        groups = generate_groups(engine, self.tokenizer, items, params)
        self.last_metrics = prefix_cache_metrics(prefill_stats(engine))
        return groups


@dataclass(slots=True)
class Episodes:
    """Multi-turn episodes played by an `grpoflow.agents.EpisodeRunner` (its metrics include the
    engine's prefill and prefix-cache counts summed over the turns)."""

    runner: Any
    tokenizer: Any

    @property
    def last_metrics(self) -> dict[str, float]:
        return self.runner.last_metrics

    def __call__(
        self, engine: RolloutEngine, items: Sequence[PromptItem], params: SamplingParams | list
    ) -> list[Group]:
        return episode_groups(self.tokenizer, self.runner.run(engine, items, params))


def generate_groups(
    engine: RolloutEngine, tokenizer, items: Sequence[PromptItem], params: SamplingParams | list
) -> list[Group]:
    """Sample `params.n` completions for each prompt item and decode them."""
    outputs = engine.generate([item.prompt_ids for item in items], params)
    return [
        Group(
            item=item,
            completions=completions,
            texts=[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions],
        )
        for item, completions in zip(items, outputs, strict=True)
    ]


def reward_inputs(groups: Sequence[Group]) -> tuple[list, list, list[list[int]], dict[str, list]]:
    """The arguments reward functions take, one entry per completion (TRL's layout): prompts,
    completions (text, or an assistant message for chat prompts), completion ids, columns."""
    prompts, completions, completion_ids = [], [], []
    columns: dict[str, list] = {}
    for group in groups:
        conversational = isinstance(group.item.prompt, list)
        for index, (completion, text) in enumerate(zip(group.completions, group.texts)):
            prompts.append(group.item.prompt)
            if conversational:
                turns = group.conversations[index] if group.conversations is not None else None
                completions.append(turns or [{"role": "assistant", "content": text}])
            else:
                completions.append(text)
            completion_ids.append(completion.token_ids)
    names = dict.fromkeys(
        name for group in groups for name in [*group.item.columns, *(group.extra_columns or {})]
    )
    for name in names:
        columns[name] = [value for group in groups for value in _column(group, name)]
    if any(group.environments is not None for group in groups):
        columns["environments"] = [
            (group.environments or [None] * len(group.completions))[index]
            for group in groups
            for index in range(len(group.completions))
        ]
    return prompts, completions, completion_ids, columns


def _column(group: Group, name: str) -> list[Any]:
    """One value of column `name` per completion of `group`: the rollout's, else the row's."""
    if group.extra_columns is not None and name in group.extra_columns:
        return list(group.extra_columns[name])
    return [group.item.columns.get(name)] * len(group.completions)


def episode_groups(tokenizer, episodes: Sequence[Sequence[Any]]) -> list[Group]:
    """Groups of played episodes (`grpoflow.agents.Episode`), one per prompt."""
    groups = []
    for members in episodes:
        completions = [episode.completion() for episode in members]
        groups.append(
            Group(
                item=members[0].item,
                completions=completions,
                texts=[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions],
                conversations=[list(episode.messages) for episode in members],
                environments=[episode.environment for episode in members],
            )
        )
    return groups


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
            self, **{name: value[rows] for name, value in tensors.items() if isinstance(value, torch.Tensor)}
        )

    def rows(self, start: int, stop: int) -> RolloutBatch:
        """Rows [start, stop) with the all-padding columns cut away."""
        prompt_mask = self.prompt_mask[start:stop]
        completion_mask = self.completion_mask[start:stop]
        first = int(prompt_mask.any(0).nonzero()[0]) if prompt_mask.any() else 0
        last = int(completion_mask.any(0).nonzero()[-1]) + 1 if completion_mask.any() else 1
        return RolloutBatch(
            prompt_ids=self.prompt_ids[start:stop, first:],
            prompt_mask=prompt_mask[:, first:],
            completion_ids=self.completion_ids[start:stop, :last],
            completion_mask=completion_mask[:, :last],
            sampling_logps=self.sampling_logps[start:stop, :last],
            truncated=self.truncated[start:stop],
            left_padded=self.left_padded and not bool(prompt_mask[:, first:].all()),
            loss_mask=self.loss_mask[start:stop, :last],
        )


def collate(groups: Sequence[Group], pad_token_id: int, device: torch.device) -> RolloutBatch:
    """Pad every completion of every group into one batch of tensors on `device`."""
    pairs = [(group.item.prompt_ids, c) for group in groups for c in group.completions]
    return collate_pairs(pairs, pad_token_id, device)


def collate_pairs(
    pairs: Sequence[tuple[Sequence[int], Completion]], pad_token_id: int, device: torch.device
) -> RolloutBatch:
    """Pad `(prompt ids, completion)` pairs into one batch of tensors on `device`: prompts on the
    left, completions on the right. Each field goes in as one flat tensor, scattered through a
    row-major mask (a row's positions in order, row after row: the pairs' order)."""
    prompt_lengths = torch.tensor([len(prompt) for prompt, _ in pairs], dtype=torch.long)
    lengths = torch.tensor([len(c.token_ids) for _, c in pairs], dtype=torch.long)
    prompt_len = int(prompt_lengths.max())
    completion_len = max(1, int(lengths.max()))
    prompt_mask = (torch.arange(prompt_len) >= prompt_len - prompt_lengths[:, None]).long()
    completion_mask = (torch.arange(completion_len) < lengths[:, None]).long()
    filled = completion_mask.bool()

    def scatter(flat: list, fill, dtype: torch.dtype, where: torch.Tensor) -> torch.Tensor:
        out = torch.full(where.shape, fill, dtype=dtype)
        out[where] = torch.tensor(flat, dtype=dtype)
        return out

    prompt_ids = scatter(_chain(p for p, _ in pairs), pad_token_id, torch.long, prompt_mask.bool())
    completion_ids = scatter(_chain(c.token_ids for _, c in pairs), pad_token_id, torch.long, filled)
    sampling_logps = scatter(_chain(c.logprobs for _, c in pairs), 0.0, torch.float32, filled)
    if all(c.mask is None for _, c in pairs):
        loss_mask = completion_mask.clone()
    else:
        loss_mask = scatter(_chain(c.loss_mask for _, c in pairs), 0, torch.long, filled)
    truncated = torch.tensor([c.truncated for _, c in pairs], dtype=torch.bool)
    return RolloutBatch(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        completion_ids=completion_ids.to(device),
        completion_mask=completion_mask.to(device),
        sampling_logps=sampling_logps.to(device),
        truncated=truncated.to(device),
        left_padded=len({len(prompt) for prompt, _ in pairs}) > 1,
        loss_mask=loss_mask.to(device),
    )


def _chain(lists: Iterable[Sequence]) -> list:
    return list(itertools.chain.from_iterable(lists))


def subset_groups(scored: ScoredGroups, keep: torch.Tensor, num_generations: int) -> ScoredGroups:
    """The groups where `keep` (num_groups,) is true, with their reward rows (errors stay with
    the caller, which collects them once per round)."""
    return ScoredGroups(
        select_groups(scored.groups, keep, 1),
        select_groups(scored.rewards, keep, num_generations),
        rounds=scored.rounds,
    )


def merge_groups(
    parts: list[ScoredGroups], num_groups: int, errors: list, rounds: int, failed: frozenset[str]
) -> ScoredGroups:
    """The first `num_groups` groups over `parts`, in order."""
    groups = [group for part in parts for group in part.groups][:num_groups]
    size = sum(len(group.completions) for group in groups)
    rewards = torch.cat([part.rewards for part in parts])[:size]
    return ScoredGroups(groups, rewards, errors, rounds, failed)
