"""Groups of completions: what a rollout makes of a step's prompts, and their rewards.

A `Rollout` turns a step's prompts into groups: `SingleTurn` samples one completion per member,
`Episodes` plays multi-turn episodes (`grpoflow.agents`). Other ways of producing groups implement
the same protocol: `grpoflow.rollout.on_policy` (completions redrawn by the trainer's forward),
`grpoflow.rollout.rollout_func` (a user's rollout function, TRL's `rollout_func`) and
`grpoflow.rollout.agent_programs` (episodes an agent program plays).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from grpoflow.algo import select_groups
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion, RolloutEngine, SamplingParams, prefix_cache_metrics
from grpoflow.rollout.program_turns import common_prefix


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
    sequence_starts: list[list[int]] | None = None
    """Per completion: the offsets in its `token_ids` where another sequence begins (the first
    token of its own prompt), for an episode whose later turns do not extend its earlier ones
    (`grpoflow.chat.trajectory`); it trains as those sequences, apart, with the episode's one
    advantage (`grpoflow.rollout.segments`). None, or [] for a completion: one sequence, its
    prompt then its tokens."""


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
    staleness: int = 0
    """Policy versions between the weights that sampled the completions and the policy they
    train (set by the source that hands them to the trainer)."""
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    """Metrics of the rollout that made them (turns per episode, prefix-cache hits, ...)."""

    def oldest_version(self) -> int:
        """The oldest policy version that sampled one of the completions."""
        return min(c.policy_version for group in self.groups for c in group.completions)


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
        self.last_metrics = prefix_cache_metrics(engine.stats.prefill)
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
    """Sample `params.n` completions for each prompt item and decode them (the engine's own texts
    where they are the same decode: `EngineCapabilities.decodes_texts`, no stop string cut them)."""
    outputs = engine.generate([item.prompt_ids for item in items], params)
    requests = params if isinstance(params, list) else [params] * len(items)
    groups = []
    for item, completions, request in zip(items, outputs, requests, strict=True):
        own = engine.capabilities.decodes_texts and not request.stop
        texts = [  # an error completion's text is its error, not a decode
            c.text
            if own and c.text is not None and c.finish_reason != "error"
            else tokenizer.decode(c.token_ids, skip_special_tokens=True)
            for c in completions
        ]
        groups.append(Group(item=item, completions=completions, texts=texts))
    return groups


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
    """Groups of played episodes (`grpoflow.agents.Episode`), one per prompt. The group's prompt
    is what its episodes' prompts (after tools and `reset`'s text went in) share; the rest of an
    episode's own prompt leads its completion, mask 0, so each trains on the sequence it sampled."""
    groups = []
    for members in episodes:
        played = [list(episode.prompt_ids) for episode in members if episode.finish != "error"]
        shared = common_prefix(played) if played else list(members[0].item.prompt_ids)
        if not shared:
            raise ValueError(
                "the episodes of one prompt begin with different tokens once their environments' reset "
                "text is in: start the prompt's template with the same tokens (a system message) for all"
            )
        completions = [episode.completion(len(shared)) for episode in members]
        groups.append(
            Group(
                item=replace(members[0].item, prompt_ids=shared),
                completions=completions,
                texts=[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions],
                conversations=[list(episode.messages) for episode in members],
                environments=[episode.environment for episode in members],
            )
        )
    return groups


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
