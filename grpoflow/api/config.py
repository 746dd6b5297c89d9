"""`GRPOConfig(**kwargs)`: TRL's GRPOConfig and the TrainingArguments fields its users set, mapped
onto the options of a run (`grpoflow.run.config`).

A field whose name is an option of grpoflow (most of TRL's: `learning_rate`, `num_generations`,
`beta`, `max_completion_length`, `output_dir`, `save_steps`, ...) sets that option, converted and
checked as a YAML key or a `--key value` flag is. The TrainingArguments fields that say the same
thing in other words are translated (`bf16`, `fp16`, `use_cpu`, `logging_strategy`, and TRL's in
`grpoflow.api.trl_fields`); a few that change nothing here are accepted with a warning naming them;
any other field is refused, by name, with why or what to set instead.
A field set to None where grpoflow's option takes no None (TRL's None for "the default") keeps
grpoflow's default. The defaults are grpoflow's (`grpoflow train --help` lists them).
"""

from __future__ import annotations

import difflib
import logging
import typing
from collections.abc import Callable
from typing import Any

from grpoflow import options
from grpoflow.api import trl_fields
from grpoflow.options.loader import coerce
from grpoflow.run.config import KEY_ALIASES
from grpoflow.run.config import GRPOConfig as RunConfig
from grpoflow.run.evaluation import EvalConfig

logger = logging.getLogger("grpoflow.api")

UNUSED_FIELDS = frozenset(
    {
        "logging_dir",
        "logging_first_step",
        "run_name",
        "log_level",
        "log_level_replica",
        "dataloader_num_workers",
        "dataloader_pin_memory",
        "dataloader_persistent_workers",
        "remove_unused_columns",
        "save_safetensors",
        "ddp_find_unused_parameters",
        "ddp_timeout",
        "include_num_input_tokens_seen",
        "dataloader_drop_last",
        "label_names",
    }
)
"""TrainingArguments fields that change nothing in a grpoflow run: accepted with a warning
(`dataloader_drop_last`: a step takes its prompts across an epoch's end, so no batch is short;
`label_names`: GRPO's completions are their own labels)."""


def _dtype(field: str, dtype: str) -> Callable[[Any], dict[str, Any]]:
    """A precision switch (`bf16`, `fp16`) as torch_dtype: on, the parameters are in that dtype;
    None (TRL's default) or off leaves torch_dtype as set."""

    def translate(value: Any) -> dict[str, Any]:
        return {"torch_dtype": dtype} if value is not None and coerce(field, value, bool) else {}

    return translate


def _use_cpu(value: Any) -> dict[str, Any]:
    return {"device": "cpu"} if coerce("use_cpu", value, bool) else {}


def _logging_strategy(value: Any) -> dict[str, Any]:
    if value not in ("steps", "no"):
        raise ValueError(
            f"logging_strategy={value!r} is not supported: grpoflow logs every logging_steps steps "
            "(logging_strategy steps)"
        )
    if value == "no":
        logger.warning("logging_strategy 'no': metrics.jsonl still gets every logging_steps step")
    return {}


def _metric_for_best_model(value: Any) -> dict[str, Any]:
    """TrainingArguments' name of an eval metric (`eval_reward`, `reward`) as grpoflow's option."""
    return {"metric_for_best_model": None if value is None else str(value).removeprefix("eval_")}


def _load_best_model_at_end(value: Any) -> dict[str, Any]:
    if coerce("load_best_model_at_end", value, bool):
        logger.warning(
            "load_best_model_at_end: the best checkpoint is kept as output_dir/checkpoint-best "
            "(metric_for_best_model); the trainer's model after train() is the last step's"
        )
    return {}


TRANSLATED: dict[str, Callable[[Any], dict[str, Any]]] = {
    "bf16": _dtype("bf16", "bfloat16"),
    "fp16": _dtype("fp16", "float16"),
    "use_cpu": _use_cpu,
    "logging_strategy": _logging_strategy,
    "metric_for_best_model": _metric_for_best_model,
    "load_best_model_at_end": _load_best_model_at_end,
    **trl_fields.TRANSLATED,
}
"""TrainingArguments fields said in other words in grpoflow, each to the options it sets. `bf16`
and `fp16` keep the parameters themselves in that dtype (no float32 master copy under autocast);
`metric_for_best_model` takes TrainingArguments' names (`eval_reward`) and grpoflow's (`reward`,
`eval/reward`) alike."""


def _refusal(name: str, fields: dict[str, Any]) -> TypeError:
    """The error of a field grpoflow does not implement: why, for a TRL field it refuses, or the
    options spelled like it."""
    if name in trl_fields.REFUSED:
        return TypeError(f"GRPOConfig field {name!r} is not supported: {trl_fields.REFUSED[name]}")
    close = difflib.get_close_matches(name, [*fields, *TRANSLATED], n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return TypeError(
        f"GRPOConfig got the field {name!r}, which grpoflow does not implement{hint} "
        "(`grpoflow train --help` lists the options)"
    )


def _takes_none(hint: Any) -> bool:
    return hint is None or type(None) in typing.get_args(hint)


class GRPOConfig:
    """A run's settings by TRL's GRPOConfig names, refused by name where grpoflow has no such field.

    `to_run_config` builds the run's config tree, the one a YAML recipe builds; reading an
    attribute gives the value set, or grpoflow's default; the fields transformers' callbacks read
    (`metric_for_best_model`, `greater_is_better`, `load_best_model_at_end`) read as
    TrainingArguments gives them.
    """

    def __init__(self, **kwargs: Any) -> None:
        fields = options.flat_fields(RunConfig)
        values: dict[str, Any] = {}
        for name, value in kwargs.items():
            if name in TRANSLATED:
                values.update(TRANSLATED[name](value))
            elif name in trl_fields.GENERATION_BATCH_FIELDS:
                continue  # checked once every field is set
            elif name in UNUSED_FIELDS:
                logger.warning("GRPOConfig: %s is accepted and not used by grpoflow", name)
            elif name in fields:
                if value is None and not _takes_none(fields[name].value_hint):
                    continue  # TRL's None for "the default": grpoflow's default
                values[name] = coerce(name, value, fields[name].value_hint)
            elif name in KEY_ALIASES:
                if KEY_ALIASES[name] is not None:
                    values[KEY_ALIASES[name]] = value
            else:
                raise _refusal(name, fields)
        trl_fields.check_generation_batch(kwargs, values, {name: fields[name].default for name in fields})
        self._given = dict(kwargs)
        self._values = values

    @classmethod
    def from_run_config(cls, config: RunConfig) -> GRPOConfig:
        """The settings of a run's config tree (a recipe's), taken as they are."""
        args = cls()
        args._values = config.to_flat_dict()
        return args

    @property
    def metric_for_best_model(self) -> str | None:
        """The eval metric whose best value's checkpoint is kept, by its logged name (`eval_reward`)."""
        metric = self._values.get("metric_for_best_model")
        return None if metric is None else f"eval_{metric.removeprefix('eval/')}"

    @property
    def greater_is_better(self) -> bool | None:
        """Whether a larger metric_for_best_model is better: as set, else as TrainingArguments
        decides it (yes, unless the metric is a loss or a length); None without a metric."""
        metric = self._values.get("metric_for_best_model")
        if metric is None:
            return self._values.get("greater_is_better")
        return EvalConfig(
            metric_for_best_model=metric, greater_is_better=self._values.get("greater_is_better")
        ).best_is_greater()

    @property
    def load_best_model_at_end(self) -> bool:
        return coerce("load_best_model_at_end", self._given.get("load_best_model_at_end", False), bool)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._values:
            return self._values[name]
        if name in self._given:
            return self._given[name]
        fields = options.flat_fields(RunConfig)
        if name in fields:
            return fields[name].default
        raise AttributeError(f"GRPOConfig has no field {name!r}")

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={value!r}" for name, value in self._given.items())
        return f"GRPOConfig({shown})"

    def to_dict(self) -> dict[str, Any]:
        """The options set, by grpoflow's flat keys."""
        return dict(self._values)

    def to_run_config(self, **values: Any) -> RunConfig:
        """The run's config: these options with `values` (flat keys) over them, every rule checked."""
        return RunConfig.from_flat_dict({**self._values, **values})
