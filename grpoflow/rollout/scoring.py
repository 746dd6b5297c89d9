"""The source of groups sampled from the run's prompts: draw prompts, play them through the run's
`Rollout`, score them with its rewards, and under `dynamic_sample` resample the prompts of groups
whose rewards have zero spread (DAPO), up to `max_resample_times` rounds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from grpoflow.algo import combine_rewards, zero_std_groups
from grpoflow.data.prompts import PromptItem
from grpoflow.distributed import DistributedContext
from grpoflow.engines import RolloutEngine
from grpoflow.phases import phase
from grpoflow.policy.placement import Placement
from grpoflow.rewards import RewardRunner
from grpoflow.rollout.groups import Rollout, ScoredGroups, merge_groups, reward_inputs, subset_groups
from grpoflow.rollout.prompt_draws import PromptDraws
from grpoflow.rollout.source import GroupSource, engine_awake


@dataclass(kw_only=True)
class SampledGroups(GroupSource):
    """Generates and scores one step's share of prompts (`rollout` and `reward` phases)."""

    rollout: Rollout
    engine: RolloutEngine
    placement: Placement
    """The policy, laid out for the engine while it generates."""
    rewards: RewardRunner
    draws: PromptDraws
    items: Sequence[PromptItem]
    dynamic_sample: bool
    """Drop groups whose rewards have zero spread and sample more prompts (DAPO)."""
    max_resample_times: int
    """Most extra sampling rounds under `dynamic_sample`."""
    num_generations: int
    num_prompts: int
    """Prompts this rank plays per step."""
    distributed: DistributedContext
    sleep: bool = True
    """The engine releases its cache after each rollout (sleep_level >= 1)."""

    def __post_init__(self) -> None:
        self.reward_names, self.reward_weights = list(self.rewards.names), self.rewards.weights

    def next(self, step: int) -> ScoredGroups:
        with engine_awake(self.engine, self.placement, self.sleep):
            scored = self.make()
        scored.staleness = step - self.engine.policy_version
        return scored

    def make(self) -> ScoredGroups:
        """This rank's scored groups, with the engine as it is (awake, or generating for itself),
        and the metrics of the rollout that made them."""
        scored = self._sample()
        scored.rollout_metrics = dict(self.rollout.last_metrics)
        return scored

    def _sample(self) -> ScoredGroups:
        """Sample and score rounds of prompts until this rank's share is kept.

        Over several ranks, each resampling round every rank takes the largest number of prompts
        any rank still lacks (so all ranks run the same rounds and walk the prompt order
        together); a rank that lacks fewer generates only those and skips the rest of its share.
        A rank that lacks none still calls the engine, with no prompts: ranks sharing an engine
        (colocated vLLM with tensor parallelism) generate together.
        """
        g = self.num_generations
        rounds = 1 + (self.max_resample_times if self.dynamic_sample else 0)
        kept: list[ScoredGroups] = []
        spare: list[ScoredGroups] = []
        errors: list = []
        failed: frozenset[str] | None = None
        rounds_run = 0
        for round_index in range(rounds):
            missing = self.num_prompts - sum(len(part.groups) for part in kept)
            share = missing if round_index == 0 else self.distributed.max_int(missing)
            if share == 0:
                break
            rounds_run += 1
            with phase("rollout"):
                indices, seeds = self.draws.take(share)
                items = [self.items[index] for index in indices[:missing]]
                groups = self.rollout(self.engine, items, self.draws.sampling_for(seeds[:missing]))
            if missing == 0:
                continue
            with phase("reward"):
                scored = self._score(groups, round_index + 1, failed)
            failed = scored.failed_everywhere
            if not self.dynamic_sample:
                return scored
            with phase("reward"):
                errors.extend(scored.errors)
                flat_mask = zero_std_groups(combine_rewards(scored.rewards, self.reward_weights), g)
                kept.append(subset_groups(scored, ~flat_mask, g))
                spare.append(subset_groups(scored, flat_mask, g))
        return merge_groups(kept + spare, self.num_prompts, errors, rounds_run, failed or frozenset())

    def _score(self, groups, rounds: int, failed: frozenset[str] | None) -> ScoredGroups:
        """Score `groups`; a completion the engine failed scores NaN. `failed`: the rewards that
        failed everywhere in the rounds before (None in the first)."""
        result = self.rewards.score(*reward_inputs(groups))
        failed = result.failed_everywhere if failed is None else failed & result.failed_everywhere
        values = result.training_values
        values[[c.finish_reason == "error" for group in groups for c in group.completions]] = float("nan")
        return ScoredGroups(groups, values, list(result.errors), rounds, failed)

    def state_dict(self) -> dict:
        return self.draws.state_dict()

    def load_state_dict(self, state: dict) -> bool:
        return self.draws.load_state_dict(state)

    def close(self) -> None:
        self.rewards.close()
