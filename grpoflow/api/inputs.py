"""What TRL's GRPOTrainer takes as Python objects, as the options of a run.

A model loaded in Python is written beside the run (`save_pretrained`) and read back from there; a
dataset (`datasets.Dataset`, `IterableDataset` or a list of dicts) becomes a jsonl file in the
output directory, so a run started from Python is one a recipe could start; reward functions given
as callables are registered under their names while the run is built; a PEFT `LoraConfig` becomes the
LoRA options. Anything these cannot carry is refused by name.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger("grpoflow.api")

INITIAL_MODEL_DIR = "initial_model"
"""Where, under output_dir, a model passed as an object is written for the run to load."""


def model_option(model: Any, processing_class: Any, output_dir: str) -> str:
    """The `model` option: a path or hub id as given, or where a loaded `PreTrainedModel` (and its
    tokenizer, `processing_class` or the one of its `name_or_path`) is written for the run."""
    if isinstance(model, str | Path):
        if processing_class is not None and getattr(processing_class, "name_or_path", None) != str(model):
            raise ValueError(
                "processing_class: grpoflow uses the tokenizer saved with the model; save yours into "
                f"{model} (tokenizer.save_pretrained) and leave processing_class unset"
            )
        return str(model)
    if not hasattr(model, "save_pretrained"):
        raise TypeError(
            f"model must be a path, a hub id or a transformers PreTrainedModel; got {type(model).__name__}"
        )
    if processing_class is None:
        from transformers import AutoTokenizer

        processing_class = AutoTokenizer.from_pretrained(model.name_or_path)
    target = Path(output_dir) / INITIAL_MODEL_DIR
    model.save_pretrained(target)
    processing_class.save_pretrained(target)
    return str(target)


def dataset_file(dataset: Any, output_dir: str, name: str) -> str:
    """`dataset` (a `datasets.Dataset`, `IterableDataset` or an iterable of dicts) written as
    output_dir/{name}.jsonl, the file the run reads its rows from; a string is taken as a dataset
    option (a packaged task, a file, a hub dataset)."""
    if isinstance(dataset, str):
        return dataset
    rows = list(_rows(dataset, name))
    if not rows:
        raise ValueError(f"{name} has no rows")
    path = Path(output_dir) / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as file:
        for index, row in enumerate(rows):
            try:
                file.write(json.dumps(row) + "\n")
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"{name} row {index}: {error}; grpoflow takes rows of JSON values (text, numbers, "
                    "lists, chat messages)"
                ) from None
    return str(path)


def _rows(dataset: Any, name: str) -> Iterable[dict]:
    if isinstance(dataset, dict) or not isinstance(dataset, Iterable):
        raise TypeError(
            f"{name} must be a datasets.Dataset, an IterableDataset or a list of dicts; "
            f"got {type(dataset).__name__}"
        )
    for row in dataset:
        if not isinstance(row, dict):
            raise TypeError(f"{name} rows must be dicts of columns; got {type(row).__name__}")
        yield row


def reward_options(reward_funcs: Any) -> tuple[dict[str, Any], dict[str, Callable[..., Any]]]:
    """The reward options of TRL's `reward_funcs` (a callable or a name, or a list of them; a
    local directory is a reward model), and the callables by their `__name__`, for the trainer to
    register while it builds its run (`registered_for_now`)."""
    specs = reward_funcs if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    names, models, functions = [], [], {}
    for spec in specs:
        if isinstance(spec, str | Path) and Path(spec).is_dir():
            models.append(str(spec))
        elif isinstance(spec, str):
            names.append(spec)
        elif callable(spec) and hasattr(spec, "__name__") and not hasattr(spec, "save_pretrained"):
            names.append(_named(spec))
            functions[names[-1]] = spec
        else:
            raise TypeError(
                f"reward_funcs: {spec!r} is not a reward function, a reward name or a reward model "
                "directory (a loaded reward model: save it with save_pretrained and pass its directory)"
            )
    if len(models) > 1:
        raise ValueError(f"reward_funcs: grpoflow takes one reward model; got {len(models)}: {models}")
    options = {"reward_funcs": names, **({"reward_model": models[0]} if models else {})}
    return options, functions


def _named(function: Callable[..., Any]) -> str:
    name = function.__name__
    if name == "<lambda>":
        raise ValueError("reward_funcs: a lambda has no name to log its reward under; use a def")
    return name


LORA_FIELDS_DEFAULTS = {
    "bias": "none",
    "use_rslora": False,
    "use_dora": False,
    "init_lora_weights": True,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}
"""PEFT LoraConfig fields grpoflow's LoRA does not vary, with the one value it takes for each."""


def lora_options(peft_config: Any) -> dict[str, Any]:
    """The LoRA options of a PEFT `LoraConfig` (r, lora_alpha, lora_dropout, target_modules,
    modules_to_save); a field set to something grpoflow's LoRA does not do is refused by name."""
    if peft_config is None:
        return {}
    if type(peft_config).__name__ != "LoraConfig":
        raise TypeError(f"peft_config must be a peft.LoraConfig; got {type(peft_config).__name__}")
    for field, default in LORA_FIELDS_DEFAULTS.items():
        value = getattr(peft_config, field, default)
        if value != default and (value or default):  # None and {} both mean "none"
            raise ValueError(
                f"peft_config.{field}={value!r} is not supported: grpoflow's LoRA takes {default!r}"
            )
    targets = peft_config.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        raise ValueError(
            f"peft_config.target_modules={targets!r}: give a list of module names (or 'all-linear'); "
            "grpoflow does not match modules by regular expression"
        )
    dropout = peft_config.lora_dropout
    return {
        "train_type": "lora",
        "lora_rank": peft_config.r,
        "lora_alpha": peft_config.lora_alpha,
        "lora_dropout": dropout,
        "target_modules": ["all-linear"] if targets in (None, "all-linear") else sorted(targets),
        "modules_to_save": list(peft_config.modules_to_save or []),
    }


def import_path(name: str, value: Any) -> Any:
    """A function or class given for an option that takes an import path (`tools`, `rollout_func`,
    `environment_factory`): its `module:qualname`; a string as it is. Objects defined in the script
    itself cannot be imported by the run's workers, and are refused."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        return [import_path(name, item) for item in value]
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(
            f"{name}: {value!r} is defined in the script itself; move it into a module and pass it "
            "(or its import path, 'package.module:name') so the run can import it"
        )
    return f"{module}:{qualname}"
