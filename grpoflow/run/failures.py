"""When a run stops by itself: a reward function that keeps failing on every sample, episodes that
all fail, rollout servers that fail past their retries, a weight sync that keeps failing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class RunStopped(RuntimeError):
    """The run stopped on purpose, after saving a checkpoint; the message says why and what next."""


class RewardFailureStreaks:
    """Per reward function, the steps in a row on which it failed on every sample.

    Args:
        names: the reward functions' names.
        limit: steps in a row after which `update` names the function; 0 never does.
    """

    def __init__(self, names: Sequence[str], limit: int) -> None:
        self.limit = limit
        self.streaks = dict.fromkeys(names, 0)

    def update(self, failed_everywhere: frozenset[str] | set[str]) -> str | None:
        """Count one step; the first function whose streak reached the limit, if any."""
        for name in self.streaks:
            self.streaks[name] = self.streaks[name] + 1 if name in failed_everywhere else 0
        if self.limit == 0:
            return None
        return next((name for name, streak in self.streaks.items() if streak >= self.limit), None)


def reward_failure_message(name: str, steps: int, step: int, saved: Path, errors: Sequence[Any]) -> str:
    """Why the run stopped at `step` and how to go on; `errors` are the step's RewardErrors."""
    last = next((error.message for error in reversed(errors) if error.name == name), "none recorded")
    return (
        f"stopped at step {step}: reward {name!r} failed on every sample for {steps} steps in a row "
        f"(last error: {last}). Checkpoint: {saved}. Fix the reward and resume with "
        "--resume_from_checkpoint latest (max_consecutive_reward_failures sets the limit; 0 never stops)"
    )


def episode_failure_message(steps: int, step: int, saved: Path, first_error: str | None) -> str:
    """Why the run stopped at `step`: every episode failed for `steps` steps in a row."""
    return (
        f"stopped at step {step}: every episode failed for {steps} steps in a row, so nothing was "
        f"learned (first error: {first_error or 'none recorded'}). Checkpoint: {saved}. Fix the "
        "environment or agent program and resume with --resume_from_checkpoint latest "
        "(max_consecutive_reward_failures sets the limit; 0 never stops)"
    )


def server_failure_message(error: Exception, step: int, saved: Path | str) -> str:
    """Why the run stopped before `step` (the rollout servers failed) and how to go on."""
    return (
        f"stopped before step {step}: the rollout server failed past its retries ({error}). Checkpoint: "
        f"{saved}. Check the server and resume with --resume_from_checkpoint latest"
    )


def sync_failure_message(error: Exception, step: int, retries: int, saved: Path) -> str:
    """Why the run stopped after `step` (its weights never reached the engine) and how to go on."""
    return (
        f"stopped after step {step}: the weight sync failed {retries + 1} time(s) ({error}). Checkpoint "
        f"of step {step}: {saved}; resuming from it sends its weights first "
        f"(--resume_from_checkpoint latest)"
    )


def batches_timeout_message(error: Exception, step: int, saved: Path | str) -> str:
    """Why the run stopped before `step`: no scored batch came in time (Atropos)."""
    return (
        f"stopped before step {step}: {error}. Checkpoint: {saved}; "
        "resume with --resume_from_checkpoint latest"
    )
