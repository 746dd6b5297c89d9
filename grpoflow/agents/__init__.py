"""Multi-turn episodes: the policy acts, tools and environments answer, until an episode ends;
and what a user's rollout function gets (`generate_rollout_completions`, TRL's helper)."""

from grpoflow.agents.rollout_trainer import RolloutTrainer, generate_rollout_completions

__all__ = ["RolloutTrainer", "generate_rollout_completions"]
