"""TRL's `reward_funcs`, `reward_processing_classes` and `reward_weights` as a run's reward options.

An entry of `reward_funcs` is a reward function, a reward model or a string:

* a callable is registered under its `__name__` while the run is built (`registered_for_now`);
* a loaded `PreTrainedModel` (a sequence classifier with one label, TRL's reward model) is written
  under output_dir with its tokenizer (its `reward_processing_classes` entry, or the one of its
  `name_or_path`), and the run loads it from there;
* TRL reads every string as a reward model's hub id or directory. grpoflow also names rewards by
  string (`accuracy`, `pkg.module:fn`, `file.py:fn`), so a string is a reward model when it is a
  local directory, or a hub id (`org/name`) that is neither a registered reward nor an import path;
  any other string names a reward function. A model's string given with a tokenizer of its own
  is loaded and written with that tokenizer, as a loaded model is.

Several reward models score a run side by side. A run puts its reward models after its reward
functions, so `reward_weights`, given in TRL's order (one per entry of `reward_funcs`), is
reordered with them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grpoflow.rewards.registry import REWARD_REGISTRY

REWARD_MODEL_DIR = "reward_model_{index}"
"""Where, under output_dir, the reward model of `reward_funcs[index]` given as an object is written."""


def reward_options(
    reward_funcs: Any, reward_processing_classes: Any, output_dir: str, reward_weights: Sequence[float] | None
) -> tuple[dict[str, Any], dict[str, Callable[..., Any]]]:
    """The reward options (`reward_funcs`, `reward_model`, `reward_weights` in the run's order) and
    the reward callables by their names, for the trainer to register while it builds its run."""
    specs = _as_list(reward_funcs)
    tokenizers = _processing_classes(reward_processing_classes, len(specs))
    names, models, functions = [], [], {}
    function_order, model_order = [], []
    for index, (spec, tokenizer) in enumerate(zip(specs, tokenizers)):
        model = _reward_model(spec, tokenizer, output_dir, index)
        if model is not None:
            models.append(model)
            model_order.append(index)
            continue
        names.append(_function_name(spec, index))
        function_order.append(index)
        if callable(spec):
            functions[names[-1]] = spec
    options: dict[str, Any] = {"reward_funcs": names}
    if models:
        options["reward_model"] = models[0] if len(models) == 1 else models
    if reward_weights is not None and len(reward_weights) == len(specs):  # else the run says what is wrong
        options["reward_weights"] = [reward_weights[index] for index in function_order + model_order]
    return options, functions


def is_reward_model_id(spec: str) -> bool:
    """Whether a string of `reward_funcs` names a reward model (rules in the module doc)."""
    if Path(spec).is_dir():
        return True
    if spec in REWARD_REGISTRY or ":" in spec or spec.endswith(".py"):
        return False
    return "/" in spec


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _processing_classes(value: Any, count: int) -> list[Any]:
    """One tokenizer (or None) per reward; TRL's rules: None for all, one for a single reward, or a list."""
    if value is None:
        return [None] * count
    tokenizers = _as_list(value)
    if len(tokenizers) != count:
        raise ValueError(
            f"reward_processing_classes has {len(tokenizers)} entries for {count} reward_funcs; give one "
            "per entry of reward_funcs (None where the model's own tokenizer serves, or for a function)"
        )
    return tokenizers


def _reward_model(spec: Any, tokenizer: Any, output_dir: str, index: int) -> str | None:
    """The `reward_model` entry of `spec` (a directory or hub id), or None when it is no model."""
    if isinstance(spec, Path) or (isinstance(spec, str) and is_reward_model_id(spec)):
        if tokenizer is None or getattr(tokenizer, "name_or_path", None) == str(spec):
            return str(spec)
        from transformers import AutoModelForSequenceClassification

        spec = AutoModelForSequenceClassification.from_pretrained(str(spec), num_labels=1)
    if not hasattr(spec, "save_pretrained"):
        return None
    _check_reward_model(spec, index)
    if tokenizer is None:
        if not spec.name_or_path:
            raise ValueError(
                f"reward_funcs[{index}]: the reward model has no name_or_path to load its tokenizer "
                "from; pass its tokenizer in reward_processing_classes"
            )
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec.name_or_path)
    target = Path(output_dir) / REWARD_MODEL_DIR.format(index=index)
    spec.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return str(target)


def _check_reward_model(model: Any, index: int) -> None:
    kind = type(model).__name__
    if not kind.endswith("ForSequenceClassification"):
        raise TypeError(
            f"reward_funcs[{index}]: a reward model is a sequence classifier "
            f"(AutoModelForSequenceClassification, num_labels=1); got a {kind}"
        )
    labels = model.config.num_labels
    if labels != 1:
        raise ValueError(
            f"reward_funcs[{index}]: the reward model has num_labels={labels}; a reward model scores "
            "with one (load it with num_labels=1)"
        )


def _function_name(spec: Any, index: int) -> str:
    if isinstance(spec, str):
        return spec
    if callable(spec) and hasattr(spec, "__name__"):
        if spec.__name__ == "<lambda>":
            raise ValueError("reward_funcs: a lambda has no name to log its reward under; use a def")
        return spec.__name__
    raise TypeError(
        f"reward_funcs[{index}]: {spec!r} is not a reward function, a reward name, a reward model or "
        "a reward model's hub id or directory"
    )
