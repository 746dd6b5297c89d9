"""Advantage estimators by name (verl's `adv_estimator`): GRPO's, RLOO and REINFORCE++.

Every estimator maps the rewards of a batch of consecutive groups to one advantage per completion,
with the signature of `group_advantages`; a plugin adds one with `@register_adv_estimator("name")`
(or names a function by import path in the config). A missing reward (NaN) is left out of every
statistic and gets advantage 0, as in `advantages.py`.

- `grpo`: `group_advantages` (the group mean subtracted, divided as `scale_rewards` says).
- `rloo` (REINFORCE Leave-One-Out, Ahmadian et al. 2024): `r_i - mean_{j != i} r_j`, which equals
  `n / (n - 1) * (r_i - mean)` over the group's `n` valid rewards. Not divided by a standard
  deviation. A group with one valid reward has no baseline: its advantage is 0 (verl keeps the raw
  reward there).
- `reinforce_plus_plus` (REINFORCE++, Hu 2025): the rewards whitened over the whole batch,
  `(r - mean) / sqrt(var + 1e-8)` with the n - 1 variance; no group baseline.
- `reinforce_plus_plus_baseline`: the group mean subtracted first, then whitened over the batch.

verl and OpenRLHF whiten per token (each completion's reward weighed by its number of tokens); here
each completion counts once, as GRPO's advantages do. `scale_rewards` applies to `grpo` alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from grpoflow.algo.advantages import group_advantages, grouped_rewards, nan_mean_std, reward_metrics
from grpoflow.algo.registry import add_entry, entry

WHITEN_EPSILON = 1e-8
"""Added to the variance before its square root when whitening, as verl does."""

AdvantageEstimator = Callable[[Tensor, int | Sequence[int], str | bool], tuple[Tensor, dict[str, Tensor]]]
"""`(rewards (batch,), num_generations or group sizes, scale_rewards) -> (advantages (batch,), metrics)`."""

ADV_ESTIMATORS: dict[str, AdvantageEstimator] = {}
"""Advantage estimators by `adv_estimator` name."""


def register_adv_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator that registers an estimator under `name`; a name taken twice is an error."""

    def register(estimator: AdvantageEstimator) -> AdvantageEstimator:
        add_entry(ADV_ESTIMATORS, "adv_estimator", name, estimator)
        return estimator

    return register


def adv_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under `name`; ValueError naming the known ones."""
    return entry(ADV_ESTIMATORS, "adv_estimator", name)


register_adv_estimator("grpo")(group_advantages)


def _whiten(values: Tensor) -> Tensor:
    """`(values - mean) / sqrt(var + 1e-8)` over all non-NaN entries (any shape)."""
    mean, std = nan_mean_std(values.reshape(-1), dim=0)
    return (values - mean) / torch.sqrt(std**2 + WHITEN_EPSILON)


def _finish(centred: Tensor, real: Tensor | None, rewards: Tensor, grouped: Tensor) -> tuple[Tensor, dict]:
    advantages = torch.nan_to_num(centred, nan=0.0)
    advantages = advantages.reshape(-1) if real is None else advantages[real]
    return advantages, reward_metrics(rewards, grouped)


@register_adv_estimator("rloo")
def rloo_advantages(
    rewards: Tensor, num_generations: int | Sequence[int], scale_rewards: str | bool = "group"
) -> tuple[Tensor, dict[str, Tensor]]:
    """Leave-one-out baseline: `r_i` minus the mean of the group's other valid rewards.

    Example: rewards `[1, 0, 0, 1, 1, 1]`, G = 3: `[1, -0.5, -0.5, 0, 0, 0]`.
    """
    grouped, real = grouped_rewards(rewards, num_generations)  # (num_groups, G)
    valid = ~torch.isnan(grouped)
    count = valid.sum(dim=1, keepdim=True)
    mean, _ = nan_mean_std(grouped, dim=1)
    loo = (grouped - mean) * count / (count - 1).clamp(min=1)
    return _finish(torch.where(count > 1, loo, torch.zeros_like(loo)), real, rewards, grouped)


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    rewards: Tensor, num_generations: int | Sequence[int], scale_rewards: str | bool = "group"
) -> tuple[Tensor, dict[str, Tensor]]:
    """Rewards whitened over the batch, no group baseline."""
    grouped, real = grouped_rewards(rewards, num_generations)
    return _finish(_whiten(grouped), real, rewards, grouped)


@register_adv_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantages(
    rewards: Tensor, num_generations: int | Sequence[int], scale_rewards: str | bool = "group"
) -> tuple[Tensor, dict[str, Tensor]]:
    """The group mean subtracted, then whitened over the batch."""
    grouped, real = grouped_rewards(rewards, num_generations)
    mean, _ = nan_mean_std(grouped, dim=1)
    return _finish(_whiten(grouped - mean), real, rewards, grouped)
