"""Rewards for GRPO: built-in rule rewards, plugins, a reward model and a runner that scores
batches with all of them concurrently.

    runner = RewardRunner.from_config(RewardConfig(reward_funcs=["accuracy", "format"]))
    batch = runner.score(prompts, completions, completion_ids, {"solution": solutions})
    batch.values  # (batch, num_funcs), NaN where missing

Reward functions follow TRL's contract (see `grpoflow.rewards.registry`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpoflow.rewards import builtin as _builtin  # noqa: F401  (registers the built-ins)
from grpoflow.rewards.params import RewardConfig
from grpoflow.rewards.plugins import load_plugins, resolve_reward
from grpoflow.rewards.registry import ORM, REWARD_REGISTRY, get_reward, orms, register_reward
from grpoflow.rewards.runner import RewardBatch, RewardError, RewardRunner, reward_name

if TYPE_CHECKING:
    from grpoflow.rewards.model import RewardModel

__all__ = [
    "ORM",
    "REWARD_REGISTRY",
    "RewardBatch",
    "RewardConfig",
    "RewardError",
    "RewardModel",
    "RewardRunner",
    "get_reward",
    "load_plugins",
    "orms",
    "register_reward",
    "resolve_reward",
    "reward_name",
]


def __getattr__(name: str) -> Any:
    # RewardModel pulls in transformers; importing it lazily keeps process-pool workers light.
    if name == "RewardModel":
        from grpoflow.rewards.model import RewardModel

        return RewardModel
    raise AttributeError(f"module 'grpoflow.rewards' has no attribute {name!r}")
