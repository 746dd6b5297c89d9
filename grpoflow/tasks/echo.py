"""The embedded default task: repeat the letter named in the prompt.

A prompt such as `echo c:` asks for `cccccccc`; the `echo` reward is the fraction of the first
eight completion characters equal to the letter. A freshly initialised model scores about 1/50;
placing its mass on the eight task letters earns 1/8, and reading the letter from the prompt earns
up to 1, so a run shows GRPO learning within minutes on a CPU.
"""

from __future__ import annotations

import random

from grpoflow.rewards import register_reward

LETTERS = "abcdefgh"
TARGET_LENGTH = 8
NUM_ROWS = {"train": 4096, "test": 256}


def split_rng(task: str, split: str) -> random.Random:
    """The random generator that makes a letter task's split, the same on every machine."""
    if split not in NUM_ROWS:
        raise ValueError(f"{task} has splits {', '.join(NUM_ROWS)}, not {split!r}")
    return random.Random(f"{task}-{split}")


def load_rows(split: str = "train") -> list[dict]:
    rng = split_rng("echo", split)
    letters = [rng.choice(LETTERS) for _ in range(NUM_ROWS[split])]
    return [{"prompt": f"echo {letter}:", "letter": letter} for letter in letters]


def echo_reward(completions: list, letter: list[str], **kwargs) -> list[float]:
    """Fraction of the first eight characters equal to the row's letter.

    >>> echo_reward(["aaaab", "ccc"], letter=["a", "c"])
    [0.5, 0.375]
    """
    scores = []
    for completion, target in zip(completions, letter, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        scores.append(sum(char == target for char in text[:TARGET_LENGTH]) / TARGET_LENGTH)
    return scores


@register_reward("echo")
def _build_echo_reward(config) -> object:
    return echo_reward
