"""Settings shared by the built-in reward functions and the reward runner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """Parameters of the built-in rewards (names follow ms-swift's GRPO options)."""

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
    max_completion_length: int = 512
    """Most tokens a completion may have; the default for `cosine_max_len` and `soft_max_length`."""
    reward_timeout: float = 60.0
    """Seconds one reward function may take on one batch before its values are dropped."""
    reward_num_workers: int = 2
    """Process-pool size for CPU-heavy rewards (math verification); 0 runs them in threads."""

    def __post_init__(self) -> None:
        _require(self.max_completion_length >= 1, "max_completion_length", ">= 1", self.max_completion_length)
        _require(
            self.cosine_max_len is None or self.cosine_max_len >= 1,
            "cosine_max_len",
            ">= 1 or None",
            self.cosine_max_len,
        )
        _require(self.repetition_n_grams >= 1, "repetition_n_grams", ">= 1", self.repetition_n_grams)
        _require(
            self.repetition_max_penalty <= 0, "repetition_max_penalty", "<= 0", self.repetition_max_penalty
        )
        _require(
            self.soft_max_length is None or self.soft_max_length >= 1,
            "soft_max_length",
            ">= 1 or None",
            self.soft_max_length,
        )
        if self.soft_cache_length is not None:
            _require(
                0 < self.soft_cache_length < self.effective_soft_max_length,
                "soft_cache_length",
                f"in (0, soft_max_length={self.effective_soft_max_length})",
                self.soft_cache_length,
            )
        _require(self.reward_timeout > 0, "reward_timeout", "> 0 (seconds)", self.reward_timeout)
        _require(self.reward_num_workers >= 0, "reward_num_workers", ">= 0", self.reward_num_workers)

    @property
    def effective_cosine_max_len(self) -> int:
        """`cosine_max_len`, or `max_completion_length` when unset."""
        return self.cosine_max_len if self.cosine_max_len is not None else self.max_completion_length

    @property
    def effective_soft_max_length(self) -> int:
        """`soft_max_length`, or `max_completion_length` when unset."""
        return self.soft_max_length if self.soft_max_length is not None else self.max_completion_length


def _require(ok: bool, field_name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"RewardConfig.{field_name} must be {allowed}, got {value!r}")
