"""A loss type registered as a plugin registers one: the clipped surrogate times a factor, reduced
as DAPO, with a settings dataclass of its own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from grpoflow.algo import LOSS_TYPES, ClipSettings, SurrogateInputs, register_loss
from grpoflow.algo.surrogates import clipped

NAME = "scaled_dapo"


@dataclass(frozen=True, slots=True)
class ScaledSettings:
    """The plugin's own hyperparameter."""

    factor: float = 2.0
    """What the clipped surrogate is multiplied by."""


@contextmanager
def scaled_loss() -> Iterator[str]:
    """Register the loss type for the `with` block, so that other tests see the built-in ones alone."""

    @register_loss(NAME, reduction="dapo", settings=ScaledSettings)
    def scaled(inputs: SurrogateInputs, settings: ScaledSettings):
        per_token_loss, metrics = clipped(inputs, ClipSettings())
        return settings.factor * per_token_loss, metrics

    try:
        yield NAME
    finally:
        del LOSS_TYPES[NAME]
