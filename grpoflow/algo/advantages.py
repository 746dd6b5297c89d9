"""Group-relative advantages: one scalar per completion, computed from the rewards of its group.

The batch is laid out as consecutive groups of `num_generations` completions of the same prompt, so
every statistic here is a reshape to `(num_groups, num_generations)` followed by a reduction along
the last dimension. Groups of different sizes (an Atropos environment chooses its own) are padded
with missing rewards to the largest and unpadded at the end.

Where this departs from the GRPO paper (it follows TRL 1.16 instead):
- The divisor is `std + 1e-4`, not `std`, and the standard deviation uses the n - 1 denominator.
- `scale_rewards="batch"` still subtracts the *group* mean but divides by the standard deviation of
  the raw rewards over the whole batch (the "PPO Lite" variant); `"none"` is Dr. GRPO's choice.
- A missing reward (NaN) is left out of every mean and standard deviation, and its completion gets
  advantage 0. A group with fewer than two valid rewards has standard deviation 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

STD_EPSILON = 1e-4
"""Added to the standard deviation before dividing, as TRL does (the paper divides by std alone)."""


def combine_rewards(rewards: Tensor, weights: Tensor) -> Tensor:
    """Weighted sum of the reward functions' outputs, skipping missing (NaN) entries.

    Args:
        rewards: `(batch, num_funcs)`; NaN where a reward function gave no reward for a sample.
        weights: `(num_funcs,)`.

    Returns:
        `(batch,)`: `sum_k weights[k] * rewards[:, k]` over the non-NaN entries; NaN for a sample
        whose rewards are all NaN (a missing reward, not a zero one).

    Example: rewards `[[1, nan], [nan, nan]]`, weights `[1, 2]` gives `[1, nan]`.
    """
    if rewards.dim() != 2 or weights.shape != (rewards.size(1),):
        raise ValueError(
            f"combine_rewards expects rewards (batch, num_funcs) and weights (num_funcs,); got "
            f"{tuple(rewards.shape)} and {tuple(weights.shape)}."
        )
    weights = weights.to(device=rewards.device, dtype=rewards.dtype)
    combined = (rewards * weights.unsqueeze(0)).nansum(dim=1)
    all_missing = torch.isnan(rewards).all(dim=1)
    return combined.masked_fill(all_missing, float("nan"))


def nan_mean_std(values: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Mean and n-1 standard deviation along `dim`, ignoring NaNs (keeps `dim`).

    The mean of no valid values is 0 and the standard deviation of fewer than two is 0.
    """
    valid = ~torch.isnan(values)
    count = valid.sum(dim=dim, keepdim=True)
    filled = torch.where(valid, values, torch.zeros_like(values))
    mean = filled.sum(dim=dim, keepdim=True) / count.clamp(min=1)
    squared = torch.where(valid, (values - mean) ** 2, torch.zeros_like(values))
    variance = squared.sum(dim=dim, keepdim=True) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, variance.sqrt(), torch.zeros_like(variance))
    return mean, std


def _group(rewards: Tensor, num_generations: int) -> Tensor:
    """`(batch,)` -> `(num_groups, num_generations)`, checking that the batch holds whole groups."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (batch,), got shape {tuple(rewards.shape)}.")
    if num_generations < 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"The batch of {rewards.numel()} rewards must be whole groups of num_generations="
            f"{num_generations}; pass a batch size that is a multiple of num_generations."
        )
    return rewards.view(-1, num_generations)


def group_reward_std(rewards: Tensor, num_generations: int) -> Tensor:
    """Standard deviation (n - 1) of the valid rewards of each group.

    Args:
        rewards: `(batch,)`, consecutive groups of `num_generations`; NaN marks a missing reward.

    Returns:
        `(num_groups,)`; 0 for a group with fewer than two valid rewards.
    """
    _, std = nan_mean_std(_group(rewards, num_generations), dim=1)
    return std.squeeze(1)


def _scale_by_group_std(grouped: Tensor, group_std: Tensor) -> Tensor:
    return group_std + STD_EPSILON


def _scale_by_batch_std(grouped: Tensor, group_std: Tensor) -> Tensor:
    _, batch_std = nan_mean_std(grouped.reshape(-1), dim=0)
    return batch_std + STD_EPSILON


def _no_scale(grouped: Tensor, group_std: Tensor) -> Tensor:
    return torch.ones_like(group_std)


ScaleFn = Callable[[Tensor, Tensor], Tensor]
"""`(grouped rewards (num_groups, G), group std (num_groups, 1)) -> divisor broadcastable to (num_groups, G)`."""

SCALE_MODES: dict[str, ScaleFn] = {
    "group": _scale_by_group_std,
    "batch": _scale_by_batch_std,
    "none": _no_scale,
}
"""How group-centred rewards are divided, by `scale_rewards` name."""

_SCALE_ALIASES = {True: "group", False: "none"}


def _resolve_scale_mode(scale_rewards: str | bool) -> ScaleFn:
    name = (
        _SCALE_ALIASES.get(scale_rewards, scale_rewards) if isinstance(scale_rewards, bool) else scale_rewards
    )
    if name not in SCALE_MODES:
        raise ValueError(
            f"Unknown scale_rewards {scale_rewards!r}; known: {sorted(SCALE_MODES)} (or True / False for "
            f"'group' / 'none')."
        )
    return SCALE_MODES[name]


def _padded_groups(rewards: Tensor, sizes: Sequence[int]) -> tuple[Tensor, Tensor]:
    """`(batch,)` -> `(num_groups, max(sizes))` padded with NaN, and the mask of real entries."""
    if rewards.dim() != 1 or sum(sizes) != rewards.numel() or min(sizes, default=1) < 1:
        raise ValueError(
            f"group sizes {list(sizes)} do not split the {rewards.numel()} rewards of shape "
            f"{tuple(rewards.shape)} into non-empty groups"
        )
    width = max(sizes)
    real = torch.arange(width, device=rewards.device) < torch.tensor(sizes, device=rewards.device)[:, None]
    grouped = torch.full((len(sizes), width), float("nan"), dtype=rewards.dtype, device=rewards.device)
    grouped[real] = rewards
    return grouped, real


def group_advantages(
    rewards: Tensor, num_generations: int | Sequence[int], scale_rewards: str | bool = "group"
) -> tuple[Tensor, dict[str, Tensor]]:
    """Advantages relative to the group mean, optionally divided by a standard deviation.

    Args:
        rewards: `(batch,)`, consecutive groups of `num_generations`; NaN marks a missing reward.
        num_generations: completions per prompt (the group size G), or each group's own size.
        scale_rewards: a key of `SCALE_MODES` ("group", "batch", "none"), or True / False as
            aliases of "group" / "none".

    Returns:
        advantages: `(batch,)`, `(r - group_mean) / divisor`; 0 where the reward is missing.
        metrics: 0-dim detached tensors (call `.item()` to log them):
            `reward` (mean of the valid rewards), `reward_std` (std of the valid rewards over the
            whole batch, as TRL logs it), `reward_group_std` (mean of the per-group std) and
            `frac_reward_zero_std` (fraction of groups whose std is close to 0).

    Example: rewards `[1, 0, 0, 1]`, G = 2, "group": each group has mean 0.5 and std 0.7071, so
    the advantages are `0.5 / (0.7071 + 1e-4) * [1, -1, -1, 1]`.
    """
    scale = _resolve_scale_mode(scale_rewards)
    grouped, real = grouped_rewards(rewards, num_generations)  # (num_groups, G)
    group_mean, group_std = nan_mean_std(grouped, dim=1)  # (num_groups, 1) each
    advantages = torch.nan_to_num((grouped - group_mean) / scale(grouped, group_std), nan=0.0)
    advantages = advantages.reshape(-1) if real is None else advantages[real]
    return advantages, reward_metrics(rewards, grouped)


def grouped_rewards(rewards: Tensor, num_generations: int | Sequence[int]) -> tuple[Tensor, Tensor | None]:
    """`(batch,)` -> `(num_groups, G)`, and for groups of different sizes (padded with NaN to the
    largest) the mask of real entries, else None."""
    if isinstance(num_generations, int):
        return _group(rewards, num_generations), None
    return _padded_groups(rewards, num_generations)


def reward_metrics(rewards: Tensor, grouped: Tensor) -> dict[str, Tensor]:
    """The reward statistics every advantage estimator logs, detached 0-dim tensors.

    Args:
        rewards: `(batch,)`, NaN where missing.
        grouped: the same as `(num_groups, G)`, padded with NaN.
    """
    batch_mean, batch_std = nan_mean_std(rewards, dim=0)
    group_std = nan_mean_std(grouped, dim=1)[1].squeeze(1)
    metrics = {
        "reward": batch_mean.squeeze(0),
        "reward_std": batch_std.squeeze(0),
        "reward_group_std": group_std.mean(),
        "frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean(),
    }
    return {name: value.detach() for name, value in metrics.items()}


def normalize_then_sum_advantages(
    rewards_per_func: Tensor, weights: Tensor, num_generations: int | Sequence[int]
) -> tuple[Tensor, dict[str, Tensor]]:
    """GDPO's decoupled normalisation (TRL's `multi_objective_aggregation="normalize_then_sum"`).

    Each reward function's rewards are normalised within their group, `(r - mean) / (std + 1e-4)`,
    then summed with `weights`, and the sums normalised over the whole batch the same way, so one
    function with a wide range cannot drown the others' group-relative signal.

    Args:
        rewards_per_func: `(batch, num_funcs)`; NaN where a function gave no reward.
        weights: `(num_funcs,)`.
        num_generations: the group size, or each group's own size.

    Returns:
        advantages: `(batch,)`; 0 for a sample with no reward at all.
        metrics: as `group_advantages`'s, of the weighted sums of the raw rewards, except
            `frac_reward_zero_std`, which says whether the batch's std of the aggregate is 0.
    """
    combined = combine_rewards(rewards_per_func, weights)  # validates the shapes
    normalized = []
    for column in rewards_per_func.unbind(dim=1):
        grouped, real = grouped_rewards(column, num_generations)
        mean, std = nan_mean_std(grouped, dim=1)
        scaled = (grouped - mean) / (std + STD_EPSILON)
        normalized.append(scaled.reshape(-1) if real is None else scaled[real])
    aggregate = combine_rewards(torch.stack(normalized, dim=1), weights)
    aggregate = aggregate.masked_fill(torch.isnan(combined), float("nan"))
    mean, std = nan_mean_std(aggregate, dim=0)
    advantages = torch.nan_to_num((aggregate - mean) / (std + STD_EPSILON), nan=0.0)
    metrics = reward_metrics(combined, grouped_rewards(combined, num_generations)[0])
    metrics["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().squeeze(0).detach()
    return advantages, metrics
