"""Environment episodes sampled on-policy by construction (`on_policy_sampling` with tools or
`environment_factory`): every token the policy samples in a turn is an exact draw from the
trainer's own forward, and its log-prob is the trainer's as the update computes it.

Each turn's completions are redrawn like single-turn ones (`grpoflow.rollout.on_policy`): the
trainer replays the engine's keyed draws on its forward of the turn's prompt (the episode so far),
and the engine continues from the first disagreement, before the environment sees the turn. Once
the episodes end, a last pass replays every episode whole, in the rows and padding of the
update's micro-batches, and gives each sampled token the log-prob of that forward. A token that
pass draws differently (the forward's rounding depends on the batch's shape) cannot be redrawn,
since the environment has answered it: it is counted in `on_policy/unconfirmed_tokens`. Where
the replay's forward passes are collectives, that pass runs as many on every rank
(`Replay.agreed_forwards`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion, EngineStats, RolloutEngine, SamplingParams
from grpoflow.rollout.groups import Group, episode_groups
from grpoflow.rollout.on_policy import OnPolicyDraws, Replay


@dataclass(slots=True)
class _RedrawingEngine:
    """What an episode runner generates each turn with: the engine's completions, redrawn."""

    engine: RolloutEngine
    draws: OnPolicyDraws

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | list
    ) -> list[list[Completion]]:
        return self.draws.generate(self.engine, prompts, params)


@dataclass(slots=True)
class OnPolicyEpisodes:
    """`Episodes` whose sampled turns the trainer's forward redraws (see the module docstring)."""

    runner: Any
    tokenizer: Any
    replay: Replay
    last_metrics: dict[str, float] = field(default_factory=dict)

    def __call__(
        self, engine: RolloutEngine, items: Sequence[PromptItem], params: SamplingParams | list
    ) -> list[Group]:
        start = time.perf_counter()
        draws = OnPolicyDraws(self.tokenizer, self.replay)
        episodes = self.runner.run(_RedrawingEngine(engine, draws), items, params)
        groups = episode_groups(self.tokenizer, episodes)
        unconfirmed = self._confirm(groups, episodes)
        self.last_metrics = {
            **self.runner.last_metrics,
            **draws.metrics(),
            "on_policy/unconfirmed_tokens": float(unconfirmed),
            "on_policy/seconds": time.perf_counter() - start,
        }
        return groups

    def _confirm(self, groups: list[Group], episodes: list[list]) -> int:
        """Replay every sampled token of the groups' episodes in the update's rows; each takes
        that forward's log-prob. Returns the tokens it draws differently."""
        rows = [
            (group.item.prompt_ids, completion, episode)
            for group, members in zip(groups, episodes)
            for completion, episode in zip(group.completions, members)
            if completion.finish_reason != "error"
        ]
        unconfirmed, size = 0, self.replay.micro_batch_size
        forwards = self.replay.agreed_forwards(len(rows))
        for start in range(0, len(rows), size):
            part = rows[start : start + size]
            keys = np.zeros((len(part), max(len(c.token_ids) for _, c, _ in part)), dtype=np.int64)
            for row, (_, completion, episode) in enumerate(part):
                keys[row, len(completion.token_ids) - len(episode.keys) : len(completion.token_ids)] = (
                    episode.keys
                )
            tokens, logprobs = self.replay.redraw(
                [(prompt, completion) for prompt, completion, _ in part], keys
            )
            for row, (_, completion, _) in enumerate(part):
                length = len(completion.token_ids)
                ours, scores = tokens[row, :length].tolist(), logprobs[row, :length].tolist()
                sampled = [index for index, kept in enumerate(completion.loss_mask) if kept]
                unconfirmed += sum(ours[index] != completion.token_ids[index] for index in sampled)
                for index in sampled:
                    completion.logprobs[index] = scores[index]
        self.replay.run_idle(forwards, len(rows))
        return unconfirmed
