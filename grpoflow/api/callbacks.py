"""transformers' `TrainerCallback` hooks on a grpoflow run, called as TRL's trainer calls them.

`Callbacks` follows the run's steps (a `StepListener` of its metrics logger): each logged step's
metrics go into `state.log_history` and to `on_log`, each step ends with `on_step_end` (and
`on_save` when the step saved its scheduled checkpoint), and a callback that sets
`control.should_training_stop` stops the run after that step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState


class TrainingStopped(Exception):  # noqa: N818 (a request, not an error)
    """A callback set `control.should_training_stop`; the run stops after the step."""


class Callbacks:
    """The user's callbacks with the trainer's state and control, called with TRL's arguments
    `(args, state, control, model=..., processing_class=..., optimizer=..., lr_scheduler=...,
    **event_kwargs)`."""

    def __init__(self, callbacks: Sequence[TrainerCallback | type[TrainerCallback]], args: Any) -> None:
        self.callbacks = [callback() if isinstance(callback, type) else callback for callback in callbacks]
        self.args = args
        self.state = TrainerState()
        self.control = TrainerControl()
        self.objects: dict[str, Any] = {}
        self.saves_at: Callable[[int], bool] = lambda step: False

    def start(self, *, total_steps: int, objects: dict[str, Any], saves_at: Callable[[int], bool]) -> None:
        """Before the first step: the run's length, the objects handed to every hook (model,
        processing_class, optimizer, lr_scheduler) and its checkpoint schedule; calls on_train_begin."""
        self.state.max_steps = total_steps
        self.state.logging_steps = self.args.logging_steps
        self.state.save_steps = self.args.save_steps
        self.objects, self.saves_at = objects, saves_at
        self.control = TrainerControl()
        self.event("on_train_begin")

    def event(self, name: str, **kwargs: Any) -> None:
        """Call hook `name` of every callback; one that returns a control replaces the current one."""
        for callback in self.callbacks:
            result = getattr(callback, name)(self.args, self.state, self.control, **self.objects, **kwargs)
            if result is not None:
                self.control = result

    def logged(self, step: int, metrics: dict[str, float]) -> None:
        """A step's metrics were logged: into log_history (with its step) and to on_log."""
        logs = dict(metrics)
        self.state.log_history.append({**logs, "step": step})
        self.event("on_log", logs=logs)

    def advanced(self, step: int, metrics: dict[str, float]) -> None:
        """A step ended: on_step_end, on_save after a scheduled checkpoint, then stop if asked."""
        self.state.global_step = step
        self.event("on_step_end")
        if self.saves_at(step):
            self.event("on_save")
        if self.control.should_training_stop:
            raise TrainingStopped(f"a callback stopped training after step {step}")
