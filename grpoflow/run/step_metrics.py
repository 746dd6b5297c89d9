"""What a step logs about its batch: completion lengths, per-reward means, and the rows of
completions.jsonl; and about the process: its peak memory and seconds per phase."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch

from grpoflow.phases import PhaseTimer
from grpoflow.rollout.batch import RolloutBatch
from grpoflow.rollout.groups import Group, ScoredGroups, reward_inputs


def length_columns(batch: RolloutBatch) -> torch.Tensor:
    """(batch, 4) long per row: tokens the policy sampled, truncated (0/1), prompt tokens, and
    completion tokens of any origin (environment turns included)."""
    return torch.stack(
        [
            batch.loss_mask.sum(1),
            batch.truncated.long(),
            batch.prompt_mask.sum(1),
            batch.completion_mask.sum(1),
        ],
        dim=1,
    ).long()


def batch_metrics(
    all_rewards: torch.Tensor, all_lengths: torch.Tensor, names: Sequence[str]
) -> dict[str, float]:
    """Metrics of the global batch: all_rewards (global_batch, num_rewards) with NaN missing,
    all_lengths (global_batch, 4) as `length_columns` lays them out."""
    lengths = all_lengths[:, 0].float()
    truncated = all_lengths[:, 1].bool()
    terminated = lengths[~truncated]
    metrics = {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "rewards/failed_fraction": all_rewards.isnan().all(dim=1).float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item() if len(terminated) else 0.0,
    }
    for index, name in enumerate(names):
        column = all_rewards[:, index]
        valid = column[~column.isnan()]
        metrics[f"rewards/{name}/mean"] = valid.mean().item() if len(valid) else float("nan")
        metrics[f"rewards/{name}/std"] = valid.std().item() if len(valid) > 1 else 0.0
    return metrics


def completion_rows(
    groups: Sequence[Group], rewards: torch.Tensor, advantages: torch.Tensor, names: Sequence[str]
) -> list[dict]:
    """One completions.jsonl row per completion: prompt, completion, rewards by name, advantage;
    and for an episode, its whole `conversation` after the prompt (turns, tool calls, tool results)."""
    prompts, completions, _, _ = reward_inputs(groups)
    conversations = [
        (group.conversations or [None] * len(group.completions))[index]
        for group in groups
        for index in range(len(group.completions))
    ]
    rows = []
    for index, (prompt, completion) in enumerate(zip(prompts, completions)):
        values = rewards[index].tolist()
        row = {
            "prompt": prompt,
            "completion": completion,
            "rewards": {name: None if math.isnan(v) else v for name, v in zip(names, values)},
            "advantage": float(advantages[index]),
        }
        if conversations[index]:
            row["conversation"] = conversations[index]
        rows.append(row)
    return rows


def peak_host_memory_gib() -> float | None:
    """The training process's peak resident memory in GiB since it started (None where the
    platform does not report it)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # bytes on macOS, KiB elsewhere


def time_metrics(timer: PhaseTimer) -> dict[str, float]:
    """A step's `time/...` metrics, the main process's own (not reduced over ranks, so that they
    add up): each phase's own seconds (`time/rollout`, `time/merge`, `time/update`, ...), which
    sum to `time/step` but for `time/other`, the seconds in no phase (the glue between phases,
    a small fraction of the step); and `time/background/<phase>`, seconds a batch generated
    ahead spent in another thread (`async_generate`), overlapping the step and not part of it."""
    metrics = {f"time/{name}": seconds for name, seconds in timer.seconds.items()}
    metrics.update({f"time/background/{name}": seconds for name, seconds in timer.background.items()})
    metrics["time/other"] = max(timer.unaccounted(), 0.0)
    metrics["time/step"] = timer.total
    return metrics


def rank_metrics(
    scored: ScoredGroups,
    batch: RolloutBatch,
    rollout_seconds: float,
    reward_names: Sequence[str],
    device: torch.device,
) -> dict[str, float]:
    """This rank's share of a step's metrics, to be summed, maxed or averaged over ranks: reward
    failures, episodes (completions) that failed and get no reward, rollout tokens/s (over `rollout_seconds`), peak memory and the rollout's own
    metrics (time/environment, time/agent: seconds inside the rollout phase)."""
    rollout_seconds = max(rollout_seconds, 1e-9)
    completions = [c for group in scored.groups for c in group.completions]
    failed = sum(c.finish_reason == "error" for c in completions)
    metrics = {
        "rewards/num_errors": float(len(scored.errors)),
        "episodes/num_errors": float(failed),
        "episodes/failed_fraction": failed / max(1, len(completions)),
        **{f"rewards/{name}/failed_all": float(name in scored.failed_everywhere) for name in reward_names},
        "tokens_per_second/rollout": batch.loss_mask.sum().item() / rollout_seconds,
    }
    if device.type == "cuda":
        metrics["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    host_peak = peak_host_memory_gib()
    if host_peak is not None:
        metrics["memory/max_rss_gib"] = host_peak
    metrics.update(scored.rollout_metrics)
    return metrics
