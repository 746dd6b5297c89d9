"""The built-in rewards: accuracy, format, cosine, repetition and soft_overlong.

They follow ms-swift's definitions (and the papers it cites) with two deliberate differences:

* cosine clamps lengths beyond `cosine_max_len` to it, so an over-long completion gets the
  max-length value instead of climbing back up the cosine;
* lengths are token counts (`len(completion_ids[i])`), never characters.

Every class here is picklable, so the CPU-heavy ones can run in the runner's process pool.
"""

from __future__ import annotations

import math
import re
from typing import Any

from grpoflow.rewards.math import AccuracyReward, gold_column, is_correct, require_math_verify
from grpoflow.rewards.params import RewardConfig
from grpoflow.rewards.registry import register_reward
from grpoflow.rewards.text import content_text

register_reward("accuracy")(AccuracyReward)

_FORMAT = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)


@register_reward("format")
def format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion is `<think>...</think>` then `<answer>...</answer>`, else 0.0.

    Example:
        >>> format_reward(["<think>2+2</think> <answer>4</answer>", "4"])
        [1.0, 0.0]
    """
    return [1.0 if _FORMAT.match(content_text(c).strip()) else 0.0 for c in completions]


def cosine_schedule(length: int, max_length: int, value_at_zero: float, value_at_max: float) -> float:
    """Cosine interpolation from `value_at_zero` (length 0) to `value_at_max` (length >= max_length)."""
    progress = min(length, max_length) / max_length
    return value_at_max + 0.5 * (value_at_zero - value_at_max) * (1.0 + math.cos(math.pi * progress))


@register_reward("cosine")
class CosineReward:
    """Length-scaled correctness ("Demystifying Long Chain-of-Thought Reasoning in LLMs").

    Correct answers earn less as they grow longer (min_len_value_correct -> max_len_value_correct);
    wrong answers are punished less as they grow longer (min_len_value_wrong -> max_len_value_wrong),
    which rewards thinking longer when wrong. None when the gold can't be parsed.
    """

    cpu_heavy = True

    def __init__(self, config: RewardConfig) -> None:
        require_math_verify("cosine")
        self.config = config

    def __call__(self, completions: list, completion_ids: list, **kwargs: Any) -> list[float | None]:
        solutions = gold_column(kwargs, len(completions))
        _check_ids(completion_ids, len(completions), "cosine")
        c = self.config
        rewards: list[float | None] = []
        for completion, solution, ids in zip(completions, solutions, completion_ids):
            correct = is_correct(content_text(completion), solution)
            if correct is None:
                rewards.append(None)
                continue
            if correct:
                at_zero, at_max = c.cosine_min_len_value_correct, c.cosine_max_len_value_correct
            else:
                at_zero, at_max = c.cosine_min_len_value_wrong, c.cosine_max_len_value_wrong
            rewards.append(cosine_schedule(len(ids), c.effective_cosine_max_len, at_zero, at_max))
        return rewards


def repetition_ratio(text: str, n: int) -> float:
    """1 - unique/total over the word n-grams of `text`; 0.0 when it has fewer than n words."""
    words = text.split()
    if len(words) < n:
        return 0.0
    ngrams = list(zip(*(words[i:] for i in range(n))))
    return 1.0 - len(set(ngrams)) / len(ngrams)


@register_reward("repetition")
class RepetitionReward:
    """`repetition_max_penalty` times the share of repeated word n-grams (0 for no repetition)."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config

    def __call__(self, completions: list, **kwargs: Any) -> list[float]:
        n, penalty = self.config.repetition_n_grams, self.config.repetition_max_penalty
        ratios = [repetition_ratio(content_text(c), n) for c in completions]
        return [ratio * penalty if ratio else 0.0 for ratio in ratios]


def soft_overlong_penalty(length: int, max_length: int, cache_length: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max-cache, linear to -1 at max, -1 beyond."""
    start = max_length - cache_length
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / cache_length
    return -1.0


@register_reward("soft_overlong")
class SoftOverlongReward:
    """DAPO's soft overlong punishment on the completion's token count."""

    def __init__(self, config: RewardConfig) -> None:
        if config.soft_cache_length is None:
            raise ValueError(
                "The soft_overlong reward needs RewardConfig.soft_cache_length (L_cache, e.g. 20% of "
                "soft_max_length); set it or drop soft_overlong from the reward functions."
            )
        self.max_length = config.effective_soft_max_length
        self.cache_length = config.soft_cache_length
        if not 0 < self.cache_length < self.max_length:
            raise ValueError(
                f"RewardConfig.soft_cache_length must be in (0, soft_max_length={self.max_length}), "
                f"got {self.cache_length}"
            )

    def __call__(self, completions: list, completion_ids: list, **kwargs: Any) -> list[float]:
        _check_ids(completion_ids, len(completions), "soft_overlong")
        return [soft_overlong_penalty(len(ids), self.max_length, self.cache_length) for ids in completion_ids]


def _check_ids(completion_ids: Any, batch_size: int, reward: str) -> None:
    if completion_ids is None or len(completion_ids) != batch_size:
        raise ValueError(
            f"The {reward} reward measures length in tokens and needs completion_ids, one list of "
            f"token ids per completion ({batch_size}); got {completion_ids!r:.100}"
        )
