"""reasoning-gym's procedural datasets as tasks: `--dataset reasoning_gym:NAME` (for example
`reasoning_gym:basic_arithmetic?size=200&seed=3&max_terms=4`), scored by the dataset's own
`score_answer` through the `reasoning_gym` reward.

The arguments are those of the dataset's config (`size`, `seed` and the dataset's own); `seed`
defaults to one drawn from the run's seed and the split, so the train and test splits differ.
Rows hold the question as the prompt and the entry's `answer` and `metadata`. The reward scores the
text inside the completion's last `<answer>...</answer>` (reasoning-gym's convention, which a
system prompt may ask for), or the whole completion when it has no such tag.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import random
import re
from collections.abc import Callable
from typing import Any

from grpoflow.rewards import register_reward
from grpoflow.rewards.text import content_text
from grpoflow.tasks.library import LibrarySpec, import_library

LIBRARY = "reasoning_gym"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def load_rows(spec: LibrarySpec, split: str, seed: int) -> list[dict]:
    """The rows of one reasoning-gym dataset (`spec.args` configure it)."""
    module = import_library("reasoning_gym", "reasoning-gym", f"dataset {spec.text!r}")
    datasets = module.factory.DATASETS
    if spec.name not in datasets:
        close = difflib.get_close_matches(spec.name, datasets, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "see reasoning_gym.factory.DATASETS"
        raise ValueError(f"dataset {spec.text!r}: reasoning-gym has no dataset {spec.name!r}; {hint}")
    args = {"seed": split_seed(seed, split), **spec.args}
    config_class = datasets[spec.name][1]
    known = {option.name for option in dataclasses.fields(config_class)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(
            f"dataset {spec.text!r}: {spec.name} takes no option {', '.join(unknown)} "
            f"(its options: {', '.join(sorted(known))})"
        )
    try:
        dataset = module.create_dataset(spec.name, **args)
    except (AssertionError, TypeError, ValueError) as error:
        raise ValueError(f"dataset {spec.text!r}: reasoning-gym refused its options: {error}") from None
    return [
        {"prompt": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}
        for entry in dataset
    ]


def split_seed(seed: int, split: str) -> int:
    """The dataset seed of a split of a run seeded with `seed`: the same on every machine."""
    return random.Random(f"{LIBRARY}-{split}-{seed}").getrandbits(31)


def extract_answer(completion: Any) -> str:
    """The text of the completion's last `<answer>` tag, else the whole completion, stripped."""
    text = content_text(completion)
    tagged = _ANSWER.findall(text)
    return (tagged[-1] if tagged else text).strip()


@functools.cache
def _scorer(dataset_name: str) -> Callable[[str | None, dict], float]:
    module = import_library("reasoning_gym", "reasoning-gym", "the reasoning_gym reward")
    return module.get_score_answer_fn(dataset_name)


def reasoning_gym_reward(
    completions: list, answer: list, metadata: list, prompts: list | None = None, **kwargs: Any
) -> list[float | None]:
    """Each completion's answer scored by the `score_answer` of the dataset that made its row
    (`metadata["source_dataset"]`); None for a row no reasoning-gym dataset made."""
    scores: list[float | None] = []
    questions = prompts if prompts is not None else [None] * len(completions)
    for completion, gold, info, question in zip(completions, answer, metadata, questions, strict=True):
        source = info.get("source_dataset") if isinstance(info, dict) else None
        if source is None:
            scores.append(None)
            continue
        entry = {"question": content_text(question) if question else "", "answer": gold, "metadata": info}
        scores.append(float(_scorer(source)(extract_answer(completion), entry)))
    return scores


@register_reward(LIBRARY)
def _build_reasoning_gym_reward(config) -> object:
    return reasoning_gym_reward
