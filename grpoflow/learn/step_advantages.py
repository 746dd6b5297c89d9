"""A step's rewards, gathered over every rank, to this rank's advantages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpoflow.algo.estimators import AdvantageEstimator
from grpoflow.distributed import DistributedContext
from grpoflow.learn.objective import AlgorithmConfig, rank_advantages
from grpoflow.rollout.groups import ScoredGroups


@dataclass(frozen=True, slots=True)
class StepAdvantages:
    """Advantages as the objective says (`adv_estimator`, `scale_rewards`, ...), over the global
    batch, then this rank's slice (groups stay whole on one rank)."""

    algorithm: AlgorithmConfig
    estimator: AdvantageEstimator
    reward_weights: torch.Tensor
    """(num_rewards,) how the reward columns add up."""
    num_generations: int
    """The group size, where the groups do not give their own sizes."""
    distributed: DistributedContext

    def __call__(
        self, all_rewards: torch.Tensor, scored: ScoredGroups, all_kl: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's advantages `(batch,)` and the reward metrics, from every rank's rewards
        `(global_batch, num_rewards)` (and each completion's KL to the reference under
        kl_in_reward); `scored` are this rank's groups."""
        size, rank = len(all_rewards) // self.distributed.world_size, self.distributed.rank
        return rank_advantages(
            self.algorithm,
            self.estimator,
            all_rewards,
            self.reward_weights,
            scored.group_sizes or self.num_generations,
            slice(rank * size, (rank + 1) * size),
            scored.zero_advantage,
            all_kl,
        )
