"""A user's rollout function (TRL's `rollout_func`) as a `Rollout`.

TRL's contract: `rollout_func(prompts, trainer)` gets one prompt per completion, each prompt
repeated `num_generations` times in a row, and returns a dict with a row per prompt of
`prompt_ids`, `completion_ids` and `logprobs` (the sampling log-prob of each completion token),
optionally `env_mask` (per completion token: 1 sampled by the policy, 0 inserted by an
environment) and any other keys, which reach the reward functions as keyword columns (a list: one
value per row; anything else: the same value for every row). `trainer` is a
`grpoflow.agents.RolloutTrainer`.

How it differs from TRL: a group's rows may carry different prompt ids (a function that writes
its own prompts); the trainer's prompt is then the prefix they share, and the rest of each row's
prompt joins its completion as environment tokens (no loss, no KL). `logprobs` may be left out
(or None): the importance-sampling correction and the log-prob gap are off for that batch.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from types import SimpleNamespace
from typing import Any

from grpoflow.agents.rollout_trainer import RolloutTrainer
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion, RolloutEngine, SamplingParams
from grpoflow.rollout.atropos import shared_prompt_length
from grpoflow.rollout.groups import Group

logger = logging.getLogger("grpoflow")

TOKEN_KEYS = ("prompt_ids", "completion_ids")
"""Keys every rollout function's output holds."""
OWN_KEYS = frozenset({*TOKEN_KEYS, "logprobs", "env_mask", "logprob_token_ids"})
"""Keys the trainer reads itself (`logprob_token_ids`, TRL's check of the sampled ids, is not
forwarded to rewards)."""
REWARD_ARGUMENTS = frozenset({"prompts", "completions", "completion_ids"})


@dataclass(slots=True)
class RolloutOutput:
    """A rollout function's output, checked: one row per prompt it was given."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    env_mask: list[list[int]] | None
    columns: dict[str, list[Any]]
    """Extra keys, one value per row."""


def check_rollout_output(output: Any, num_rows: int, vocab_size: int, num_generations: int) -> RolloutOutput:
    """`output` checked against TRL's contract; ValueError or TypeError naming the key and the fix."""
    if not isinstance(output, Mapping):
        raise TypeError(
            f"rollout_func returned a {type(output).__name__}; it must return a dict with prompt_ids, "
            "completion_ids and logprobs (one row per prompt it was given)"
        )
    missing = [key for key in TOKEN_KEYS if key not in output]
    if missing:
        raise ValueError(
            f"rollout_func's output lacks {missing} (it has {sorted(output)}): return prompt_ids, completion_ids "
            "and logprobs, one row per prompt it was given"
        )
    shape = (
        f"it was given {num_rows} prompts ({num_rows // num_generations} x num_generations {num_generations})"
    )
    prompt_ids = [
        _ids(output, "prompt_ids", row, vocab_size) for row in _rows(output, "prompt_ids", num_rows, shape)
    ]
    completion_ids = [
        _ids(output, "completion_ids", row, vocab_size)
        for row in _rows(output, "completion_ids", num_rows, shape)
    ]
    for index, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(
                f"rollout_func's prompt_ids row {index} is empty: every completion needs its prompt's ids"
            )
    logprobs = _per_token(output, "logprobs", completion_ids, shape, _logprob)
    env_mask = _per_token(output, "env_mask", completion_ids, shape, _mask_value)
    columns = {}
    for key in sorted(set(output) - OWN_KEYS):
        if key in REWARD_ARGUMENTS:
            raise ValueError(f"rollout_func's key {key!r} is a reward function argument; rename it")
        value = output[key]
        columns[key] = (
            list(_rows(output, key, num_rows, shape))
            if isinstance(value, list | tuple)
            else [value] * num_rows
        )
    return RolloutOutput(prompt_ids, completion_ids, logprobs, env_mask, columns)


def _rows(output: Mapping, key: str, num_rows: int, shape: str) -> list:
    rows = output[key]
    if hasattr(rows, "tolist"):
        rows = rows.tolist()
    if not isinstance(rows, list | tuple) or len(rows) != num_rows:
        got = f"{len(rows)} rows" if isinstance(rows, list | tuple) else f"a {type(rows).__name__}"
        raise ValueError(
            f"rollout_func returned {got} of {key!r}; {shape}: return a list with one row per prompt"
        )
    return list(rows)


def _ids(output: Mapping, key: str, row: Any, vocab_size: int) -> list[int]:
    row = row.tolist() if hasattr(row, "tolist") else row
    if not isinstance(row, list | tuple):
        raise ValueError(
            f"rollout_func's {key!r} rows must be lists of token ids, got a {type(row).__name__}"
        )
    for token in row:
        if isinstance(token, bool) or not isinstance(token, Integral) or not 0 <= token < vocab_size:
            raise ValueError(
                f"rollout_func's {key!r} holds {token!r}, not a token id in [0, {vocab_size}): return the ids the "
                "tokenizer and engine produced (e.g. generate_rollout_completions' prompt_ids / completion_ids)"
            )
    return [int(token) for token in row]


def _per_token(
    output: Mapping, key: str, completion_ids: list[list[int]], shape: str, convert: Callable[[Any], Any]
) -> list[list] | None:
    """Rows of one value per completion token (`logprobs`, `env_mask`); None when absent."""
    if output.get(key) is None:
        return None
    rows = _rows(output, key, len(completion_ids), shape)
    checked = []
    for index, (row, ids) in enumerate(zip(rows, completion_ids)):
        row = row.tolist() if hasattr(row, "tolist") else row
        if not isinstance(row, list | tuple) or len(row) != len(ids):
            size = len(row) if isinstance(row, list | tuple) else type(row).__name__
            raise ValueError(
                f"rollout_func's {key!r} row {index} has {size} values for {len(ids)} completion tokens: give one "
                "value per completion token"
            )
        try:
            checked.append([convert(value) for value in row])
        except (TypeError, ValueError) as error:
            raise ValueError(f"rollout_func's {key!r} row {index}: {error}") from None
    return checked


def _logprob(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite log-prob")
    return float(value)


def _mask_value(value: Any) -> int:
    if value not in (0, 1):
        raise ValueError(f"{value!r} is not 0 (environment token) or 1 (policy token)")
    return int(value)


def output_groups(
    output: RolloutOutput,
    items: Sequence[PromptItem],
    num_generations: int,
    *,
    tokenizer,
    stop_token_ids: Sequence[int],
    policy_version: int,
) -> list[Group]:
    """One group per item from its `num_generations` consecutive rows."""
    groups = []
    for index, item in enumerate(items):
        rows = range(index * num_generations, (index + 1) * num_generations)
        prompts = [output.prompt_ids[row] for row in rows]
        split = shared_prompt_length(prompts, [len(prompt) for prompt in prompts])
        if split == 0:
            logger.warning(
                "rollout_func's completions of one prompt share no prompt token; the group gets no reward"
            )
            completions = [Completion([], [], "error", policy_version, mask=[]) for _ in rows]
            groups.append(Group(item=item, completions=completions, texts=[""] * len(rows)))
            continue
        completions = [_completion(output, row, split, stop_token_ids, policy_version) for row in rows]
        groups.append(
            Group(
                item=dataclasses.replace(item, prompt_ids=prompts[0][:split]),
                completions=completions,
                texts=[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions],
                extra_columns={
                    name: values[rows.start : rows.stop] for name, values in output.columns.items()
                },
                sampling_logprobs=output.logprobs is not None,
            )
        )
    return groups


def _completion(
    output: RolloutOutput, row: int, split: int, stop_token_ids: Sequence[int], policy_version: int
) -> Completion:
    """A row's completion: the rest of its prompt (environment tokens) and its completion ids."""
    rest = output.prompt_ids[row][split:]
    ids = output.completion_ids[row]
    policy_mask = output.env_mask[row] if output.env_mask is not None else [1] * len(ids)
    logprobs = output.logprobs[row] if output.logprobs is not None else [0.0] * len(ids)
    finish = "stop" if not ids or ids[-1] in stop_token_ids else "length"  # TRL's truncation rule
    return Completion(
        token_ids=rest + ids,
        logprobs=[0.0] * len(rest) + [value if kept else 0.0 for value, kept in zip(logprobs, policy_mask)],
        finish_reason=finish,
        policy_version=policy_version,
        mask=[0] * len(rest) + policy_mask,
    )


@dataclass(slots=True)
class RolloutFunction:
    """A step's prompts played by a user's `rollout_func(prompts, trainer)` (module docstring)."""

    function: Callable[[list, RolloutTrainer], Any]
    tokenizer: Any
    args: SimpleNamespace
    """The run's options by flat key (`trainer.args`)."""
    per_prompt_params: bool = False
    vocab_size: int | None = None
    """Token ids at or above it are refused; unset: the tokenizer's size (the run sets the
    policy's embedding rows, which may be more)."""
    last_metrics: dict[str, float] = field(default_factory=dict)
    _warned: bool = False

    def __call__(
        self, engine: RolloutEngine, items: Sequence[PromptItem], params: SamplingParams | list
    ) -> list[Group]:
        if not items:  # ranks sharing an engine generate together, with or without prompts
            engine.generate([], params)
            return []
        base = params[0] if isinstance(params, list) else params
        num_generations = base.n
        trainer = RolloutTrainer(
            processing_class=self.tokenizer,
            args=self.args,
            engine=engine,
            sampling=dataclasses.replace(base, n=1, seed=None),
            num_generations=num_generations,
            per_prompt_params=self.per_prompt_params,
            seed=base.seed,
        )
        prompts = [copy.deepcopy(item.prompt) for item in items for _ in range(num_generations)]
        output = check_rollout_output(
            self.function(prompts, trainer),
            len(prompts),
            self.vocab_size or len(self.tokenizer),
            num_generations,
        )
        if output.logprobs is None and not self._warned:
            self._warned = True
            logger.warning(
                "rollout_func returned no logprobs: the importance-sampling correction and the log-prob gap "
                "are off for its batches"
            )
        masked = sum(row.count(0) for row in output.env_mask) if output.env_mask is not None else 0
        tokens = sum(len(row) for row in output.completion_ids)
        self.last_metrics = {"rollout_func/env_token_fraction": masked / tokens if tokens else 0.0}
        return output_groups(
            output,
            items,
            num_generations,
            tokenizer=self.tokenizer,
            stop_token_ids=[*base.stop_token_ids, self.tokenizer.pad_token_id],
            policy_version=engine.policy_version,
        )
