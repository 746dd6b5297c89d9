"""The rewards section: which rewards score completions, how the runner calls them, and the
built-in rewards' parameters (names follow TRL's and ms-swift's GRPO options). Every reward
factory and plugin class receives it."""

from __future__ import annotations

from dataclasses import dataclass, field

from grpoflow.engines.base import SamplingParams
from grpoflow.options import default_of, derived_from, require


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """Which rewards score completions, and their parameters."""

    reward_funcs: list[str] = field(default_factory=list)
    """Registered names (accuracy, format, cosine, repetition, soft_overlong, ...) or import paths
    (`pkg.module:function`, `file.py:function`)."""
    reward_weights: list[float] | None = None
    """One weight per reward (reward_model last); all 1.0 when unset."""
    reward_model: str | list[str] | None = None
    """A sequence-classification model scoring prompt + completion (a directory or hub id), or a
    list of them; one is logged as reward_model, several each by its name (the path's last part)."""
    external_plugins: list[str] = field(default_factory=list)
    """Python files to load before rewards are resolved (they register rewards)."""

    cosine_min_len_value_wrong: float = -0.5
    """cosine: reward of a wrong answer of length 0."""
    cosine_max_len_value_wrong: float = 0.0
    """cosine: reward of a wrong answer of length `cosine_max_len` or more."""
    cosine_min_len_value_correct: float = 1.0
    """cosine: reward of a correct answer of length 0."""
    cosine_max_len_value_correct: float = 0.5
    """cosine: reward of a correct answer of length `cosine_max_len` or more."""
    cosine_max_len: int | None = None
    """cosine: length (tokens) where the schedule ends; None means `max_completion_length`."""
    repetition_n_grams: int = 3
    """repetition: size of the word n-grams counted."""
    repetition_max_penalty: float = -1.0
    """repetition: reward (<= 0) of a completion made of one repeated n-gram."""
    soft_max_length: int | None = None
    """soft_overlong: L_max in tokens; None means `max_completion_length`."""
    soft_cache_length: int | None = None
    """soft_overlong: L_cache, the width of the linear penalty band below L_max (required for it)."""
    max_completion_length: int = field(
        default=default_of(SamplingParams, "max_tokens"), metadata=derived_from("max_completion_length")
    )
    """Most tokens a completion may have (the run sets it from its max_completion_length); the
    default for `cosine_max_len` and `soft_max_length`."""
    reward_timeout: float = 60.0
    """Seconds one reward function may take on one batch before its values are dropped."""
    reward_num_workers: int = 2
    """Process-pool size for CPU-heavy rewards (math verification); 0 runs them in threads."""
    max_consecutive_reward_failures: int = 5
    """Stop the run, with a checkpoint, when one reward function has failed on every sample (raised,
    timed out, answered wrongly), or every episode failed, this many steps in a row; 0 never stops."""

    def __post_init__(self) -> None:
        require(self.max_completion_length >= 1, "max_completion_length", ">= 1", self.max_completion_length)
        for name in ("cosine_max_len", "soft_max_length"):
            value = getattr(self, name)
            require(value is None or value >= 1, name, ">= 1 (or unset)", value)
        require(self.repetition_n_grams >= 1, "repetition_n_grams", ">= 1", self.repetition_n_grams)
        require(
            self.repetition_max_penalty <= 0, "repetition_max_penalty", "<= 0", self.repetition_max_penalty
        )
        if self.soft_cache_length is not None:
            require(
                0 < self.soft_cache_length < self.effective_soft_max_length,
                "soft_cache_length",
                f"in (0, soft_max_length={self.effective_soft_max_length})",
                self.soft_cache_length,
            )
        require(self.reward_timeout > 0, "reward_timeout", "> 0 (seconds)", self.reward_timeout)
        require(self.reward_num_workers >= 0, "reward_num_workers", ">= 0", self.reward_num_workers)
        require(
            self.max_consecutive_reward_failures >= 0,
            "max_consecutive_reward_failures",
            ">= 0 (0 never stops)",
            self.max_consecutive_reward_failures,
        )
        num_rewards = len(self.reward_funcs) + len(self.reward_models)
        require(
            self.reward_weights is None or len(self.reward_weights) == num_rewards,
            "reward_weights",
            f"one weight per reward: there are {num_rewards} rewards (reward_funcs, then reward_model)",
            self.reward_weights,
        )

    @property
    def reward_models(self) -> list[str]:
        """`reward_model` as a list (empty when unset)."""
        if not self.reward_model:
            return []
        return [self.reward_model] if isinstance(self.reward_model, str) else list(self.reward_model)

    @property
    def effective_cosine_max_len(self) -> int:
        """`cosine_max_len`, or `max_completion_length` when unset."""
        return self.cosine_max_len if self.cosine_max_len is not None else self.max_completion_length

    @property
    def effective_soft_max_length(self) -> int:
        """`soft_max_length`, or `max_completion_length` when unset."""
        return self.soft_max_length if self.soft_max_length is not None else self.max_completion_length
