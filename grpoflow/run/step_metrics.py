"""What a step logs about its batch: completion lengths, per-reward means, and the rows of
completions.jsonl; and about the process: its peak memory."""

from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from grpoflow.run.rollout import Group, RolloutBatch, ScoredGroups, reward_inputs


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
    """One completions.jsonl row per completion: prompt, completion, rewards by name, advantage."""
    prompts, completions, _, _ = reward_inputs(groups)
    rows = []
    for index, (prompt, completion) in enumerate(zip(prompts, completions)):
        values = rewards[index].tolist()
        rows.append(
            {
                "prompt": prompt,
                "completion": completion,
                "rewards": {name: None if math.isnan(v) else v for name, v in zip(names, values)},
                "advantage": float(advantages[index]),
            }
        )
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


class Timer:
    """Wall-clock seconds per phase of a step; `synchronize` waits for the GPU at each phase's end
    (off in a background thread, where it would wait for the trainer's kernels too)."""

    def __init__(self, synchronize: bool = True) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.synchronize = synchronize and torch.cuda.is_available()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.synchronize:
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - start


def rank_metrics(
    scored: ScoredGroups,
    batch: RolloutBatch,
    timer: Timer,
    reward_names: Sequence[str],
    device: torch.device,
    rollout_metrics: dict[str, float],
) -> dict[str, float]:
    """This rank's share of a step's metrics, to be summed, maxed or averaged over ranks: reward
    failures, rollout tokens/s, peak memory, seconds per phase and the rollout's own metrics."""
    rollout_seconds = max(timer.seconds["rollout"], 1e-9)
    metrics = {
        "rewards/num_errors": float(len(scored.errors)),
        **{f"rewards/{name}/failed_all": float(name in scored.failed_everywhere) for name in reward_names},
        "tokens_per_second/rollout": batch.loss_mask.sum().item() / rollout_seconds,
    }
    if device.type == "cuda":
        metrics["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    host_peak = peak_host_memory_gib()
    if host_peak is not None:
        metrics["memory/max_rss_gib"] = host_peak
    for phase, seconds in timer.seconds.items():
        metrics[f"time/{phase}"] = seconds
    metrics.update(rollout_metrics)
    return metrics
