"""What TRL's GRPOTrainer takes as Python objects, as the options of a run.

A model loaded in Python is written beside the run (`save_pretrained`) and read back from there; a
dataset (`datasets.Dataset`, `IterableDataset` or a list of dicts) becomes a jsonl file in the
output directory, so a run started from Python is one a recipe could start; a PEFT `LoraConfig`
becomes the LoRA options; tools, a rollout function and environment factories given as objects are
provided to the run under their import paths while it is built (rewards: `grpoflow.api.rewards`).
Anything these cannot carry is refused by name.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
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
    # Every rank of a torchrun job writes the same rows: each to a file of its own, renamed into
    # place whole, so no rank reads a file another is still writing.
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with partial.open("w", encoding="utf-8") as file:
            for index, row in enumerate(rows):
                try:
                    file.write(json.dumps(row) + "\n")
                except (TypeError, ValueError) as error:
                    raise ValueError(
                        f"{name} row {index}: {error}; grpoflow takes rows of JSON values (text, "
                        "numbers, lists, chat messages)"
                    ) from None
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
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
    target_parameters, modules_to_save); a field set to something grpoflow's LoRA does not do is refused by name."""
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
        "target_parameters": sorted(getattr(peft_config, "target_parameters", None) or []),
        "modules_to_save": list(peft_config.modules_to_save or []),
    }


def object_options(named: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The options of the arguments that take code (`tools`, `rollout_func`, `environment_factory`,
    a mapping of names to factories included), and the objects the run takes under them.

    A string is an import path, as it is. A function or class becomes the import path that names it
    (`module:qualname`, e.g. `__main__:multiply`), with the object itself provided under that path
    while the run is built (`imports.provided_for_now`): one defined in the script itself, in
    `__main__` or inside a function, reaches the run as it is, since the run builds in this process.
    """
    provided: dict[str, Any] = {}

    def option(name: str, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, list | tuple):
            return [option(f"{name}[{index}]", item) for index, item in enumerate(value)]
        if isinstance(value, Mapping):
            return {key: option(f"{name}[{key!r}]", item) for key, item in value.items()}
        if not callable(value):
            raise TypeError(
                f"{name}: {value!r} is a {type(value).__name__}; give a function or class, or its "
                "import path ('package.module:name')"
            )
        spec = _object_path(value, provided)
        provided[spec] = value
        return spec

    options = {name: option(name, value) for name, value in named.items() if value is not None}
    return options, provided


def _object_path(value: Any, taken: Mapping[str, Any]) -> str:
    """`module:qualname` of `value`; another object of the same name gets `#2`, `#3`, ... after it."""
    module = getattr(value, "__module__", None) or "__main__"
    qualname = getattr(value, "__qualname__", None) or type(value).__qualname__
    spec, count = f"{module}:{qualname}", 1
    while spec in taken and taken[spec] is not value:
        count += 1
        spec = f"{module}:{qualname}#{count}"
    return spec


def unsupported_arguments(optimizers: Any, quantization_config: Any) -> None:
    """Refuse TRL's `optimizers` (other than its default `(None, None)`) and `quantization_config`,
    each with what grpoflow does instead."""
    if tuple(optimizers or (None, None)) != (None, None):
        raise ValueError(
            "optimizers is not supported: grpoflow builds AdamW and its schedule from the config; set "
            "learning_rate, adam_beta1, adam_beta2, weight_decay, optim and lr_scheduler_type instead"
        )
    if quantization_config is not None:
        raise ValueError(
            "quantization_config is not supported: grpoflow trains unquantized weights; leave it unset "
            "(peft_config trains LoRA adapters on them)"
        )
