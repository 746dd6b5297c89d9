"""One reward function on one batch, with bad samples isolated and the return value checked.

This runs wherever the function runs: a thread, a process-pool worker (so everything here is
picklable and module-level) or the runner's event loop (`evaluate_async`). It never raises for
the function's sake: failures come back as NaN values plus `(index or None, message)` errors.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpoflow.rewards.text import preview

NAN = float("nan")


@dataclass(slots=True)
class RewardCall:
    """The arguments of one reward call; `columns` also holds extra keyword arguments."""

    prompts: list
    completions: list
    completion_ids: list
    columns: dict[str, Any]

    def __len__(self) -> int:
        return len(self.completions)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments in TRL's reward-function contract."""
        return {
            "prompts": self.prompts,
            "completions": self.completions,
            "completion_ids": self.completion_ids,
            **self.columns,
        }

    def sample(self, index: int) -> RewardCall:
        """The call restricted to one sample; values that aren't per-sample lists pass unchanged."""
        size = len(self)

        def pick(value: Any) -> Any:
            if isinstance(value, (list, tuple)) and len(value) == size:
                return value[index : index + 1]
            return value

        return RewardCall(
            pick(self.prompts),
            pick(self.completions),
            pick(self.completion_ids),
            {name: pick(value) for name, value in self.columns.items()},
        )


@dataclass(slots=True)
class Outcome:
    """Values (NaN where missing or bad) and `(sample index or None, message)` errors."""

    values: list[float]
    errors: list[tuple[int | None, str]]


def evaluate(fn: Callable[..., Any], call: RewardCall) -> Outcome:
    """Call `fn` on the batch; if it raises, call it on each sample to keep the good values."""
    try:
        raw = fn(**call.kwargs())
    except Exception as batch_error:
        results: list[Outcome | BaseException] = []
        for index in range(len(call)):
            try:
                results.append(normalize(fn(**call.sample(index).kwargs()), 1))
            except Exception as error:
                results.append(error)
        return merge_samples(call, batch_error, results)
    return normalize(raw, len(call))


async def evaluate_async(fn: Callable[..., Any], call: RewardCall) -> Outcome:
    """`evaluate` for async functions; the per-sample retries run concurrently."""
    try:
        raw = await fn(**call.kwargs())
    except Exception as batch_error:

        async def one(index: int) -> Outcome:
            return normalize(await fn(**call.sample(index).kwargs()), 1)

        results = await asyncio.gather(*(one(i) for i in range(len(call))), return_exceptions=True)
        return merge_samples(call, batch_error, results)
    return normalize(raw, len(call))


def merge_samples(
    call: RewardCall, batch_error: BaseException, results: Sequence[Outcome | BaseException]
) -> Outcome:
    """Combine per-sample retries after the batch call raised `batch_error`."""
    values: list[float] = []
    errors: list[tuple[int | None, str]] = []
    for index, result in enumerate(results):
        if isinstance(result, BaseException):
            values.append(NAN)
            completion = preview(call.completions[index])
            errors.append((index, f"raised {describe_exception(result)} on completion {completion!r}"))
        else:
            values.append(result.values[0])
            errors.extend((index, message) for _, message in result.errors)
    if not errors:
        message = f"raised {describe_exception(batch_error)} on the batch but on no single sample"
        errors.append((None, message + "; kept the per-sample values"))
    return Outcome(values, errors)


def normalize(raw: Any, size: int) -> Outcome:
    """Check a return value is `size` numbers or None; anything else becomes NaN plus an error."""
    items = raw.tolist() if hasattr(raw, "tolist") and not isinstance(raw, (list, tuple)) else raw
    if not isinstance(items, (list, tuple)):
        message = f"returned {describe(raw)}; a reward function must return a list of {size} floats (None for no reward)"
        return Outcome([NAN] * size, [(None, message)])
    if len(items) != size:
        message = (
            f"returned {len(items)} values for {size} completions; it must return one value per completion"
        )
        return Outcome([NAN] * size, [(None, message)])
    values: list[float] = []
    errors: list[tuple[int | None, str]] = []
    for index, item in enumerate(items):
        value = _as_float(item)
        if value is None or math.isinf(value):
            values.append(NAN)
            errors.append(
                (index if size > 1 else None, f"returned {describe(item)}; expected a finite float or None")
            )
        else:
            values.append(value)
    return Outcome(values, errors)


def describe(value: Any, limit: int = 100) -> str:
    """`type value` shortened, for error messages."""
    text = repr(value)
    return f"{type(value).__name__} {text[:limit]}{'...' if len(text) > limit else ''}"


def describe_exception(error: BaseException) -> str:
    """`Type: message (at file:line)` of the innermost frame."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {error}{where}"


def _as_float(item: Any) -> float | None:
    """The item as a float (None and NaN give NaN); None when it isn't a number."""
    if item is None:
        return NAN
    if isinstance(item, (str, bytes)):
        return None
    if not isinstance(item, numbers.Real) and not hasattr(item, "__float__"):
        return None
    try:
        return float(item)
    except (TypeError, ValueError):
        return None
