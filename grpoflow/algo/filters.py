"""DAPO's batch filters (dynamic sampling, the overlong filter) and DeepSeek-V3.2's off-policy mask.

DAPO resamples until every group in the batch has a non-zero reward spread; here
`zero_std_groups` finds the groups to drop and `select_groups` keeps the rest, and the trainer
decides whether to top the batch up. The overlong filter removes truncated completions from the
loss (TRL's `mask_truncated_completions`) without changing their rewards or advantages.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

from grpoflow.algo.advantages import group_reward_std

Rows = TypeVar("Rows", Tensor, list)


def zero_std_groups(rewards: Tensor, num_generations: int) -> Tensor:
    """Groups whose valid rewards have no spread, so all their advantages are 0.

    Args:
        rewards: `(batch,)`, consecutive groups of `num_generations`; NaN marks a missing reward.

    Returns:
        `(num_groups,)` bool, True where the group std is close to 0 (including groups with fewer
        than two valid rewards).
    """
    std = group_reward_std(rewards, num_generations)
    return torch.isclose(std, torch.zeros_like(std))


def overlong_mask(mask: Tensor, truncated: Tensor) -> Tensor:
    """Zero the loss mask of completions cut off by the length limit.

    Args:
        mask: `(batch, seq)` completion mask.
        truncated: `(batch,)` bool, True where generation stopped at the length limit.

    Returns:
        `(batch, seq)` mask of the same dtype, all zeros on truncated rows.
    """
    if truncated.shape != mask.shape[:1]:
        raise ValueError(f"truncated must be (batch,) = ({mask.size(0)},), got {tuple(truncated.shape)}.")
    keep = (~truncated.bool()).to(mask.dtype)
    return mask * keep.unsqueeze(1)


def select_groups(values: Rows, keep_groups: Tensor, num_generations: int) -> Rows:
    """Keep the rows of the kept groups.

    Args:
        values: a tensor with leading dimension `batch`, or a list of `batch` items, laid out as
            consecutive groups of `num_generations`.
        keep_groups: `(num_groups,)` bool.

    Returns:
        The same kind of object with `keep_groups.sum() * num_generations` rows, in order.

    Example: `select_groups(["a", "b", "c", "d"], tensor([False, True]), 2)` gives `["c", "d"]`.
    """
    num_rows = keep_groups.numel() * num_generations
    if len(values) != num_rows:
        raise ValueError(
            f"Expected {num_rows} rows ({keep_groups.numel()} groups of {num_generations}), got {len(values)}."
        )
    keep_rows = keep_groups.bool().repeat_interleave(num_generations)
    if isinstance(values, Tensor):
        return values[keep_rows.to(values.device)]
    return [value for value, keep in zip(values, keep_rows.tolist()) if keep]


def off_policy_mask(
    advantages: Tensor, logps: Tensor, sampling_logps: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask: drop a completion with negative advantage whose
    mean per-token `log pi_sampler - log pi` over its tokens exceeds `threshold`.

    Args:
        advantages: `(batch,)`, or `(batch, 1 or seq)`.
        logps: `(batch, seq)` the policy's log-probs now (detached here).
        sampling_logps: `(batch, seq)` log-probs under the policy that sampled; NaN where unknown
            (counted as no divergence).
        mask: `(batch, seq)`, 1 on completion tokens.
        threshold: the paper's delta.

    Returns:
        `(batch, 1)` (`(batch, seq)` for per-token advantages) of `logps`' dtype: 1 keeps, 0 drops.
    """
    mask = mask.to(logps.dtype)
    divergence = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
    mean_divergence = (divergence * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    advantages = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    return ((advantages >= 0) | (mean_divergence <= threshold)).to(mask.dtype)
