"""transformers' `TrainerCallback` hooks on a grpoflow run, called as TRL's trainer calls them.

`Callbacks` follows the run's steps (a `StepListener` of its metrics logger): each step starts
with `on_step_begin`; each logged step's metrics go into `state.log_history` and to `on_log`, its
evaluation's (the run's `eval/...` metrics, renamed `eval_...` as transformers names them) into a
log entry of their own, to `on_log` and to `on_evaluate`; each step ends with `on_step_end` (and
`on_save` when the step saved its scheduled checkpoint), and a callback that sets
`control.should_training_stop` (`EarlyStoppingCallback` among them) stops the run after that step.
Under torchrun the callbacks run on every rank, with the same metrics (averaged over ranks) and
`state.is_world_process_zero` true on rank 0 alone; a stop asked on any rank stops every rank
after the same step.
`state.epoch` counts the steps done in epochs of the training prompts, and `state.best_metric`
follows metric_for_best_model at each evaluation during training, as transformers' Trainer keeps
them.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState

EVAL_PREFIX = "eval/"
"""How the run names its evaluation's metrics."""


class TrainingStopped(Exception):  # noqa: N818 (a request, not an error)
    """A callback set `control.should_training_stop`; the run stops after the step."""


def renamed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """The run's `eval/...` metrics as transformers names them: `{prefix}_...`."""
    return {f"{prefix}_{name.removeprefix(EVAL_PREFIX)}": value for name, value in metrics.items()}


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
        """What every hook gets besides its arguments: model, processing_class, optimizer, lr_scheduler."""
        self.saves_at: Callable[[int], bool] = lambda step: False
        self.steps_per_epoch: float | None = None
        self.any_rank: Callable[[bool], bool] = bool

    def start(
        self,
        *,
        total_steps: int,
        saves_at: Callable[[int], bool],
        steps_per_epoch: float | None = None,
        step: int = 0,
        history: Sequence[dict[str, Any]] = (),
        rank: tuple[bool, bool] = (True, True),
        any_rank: Callable[[bool], bool] = bool,
    ) -> None:
        """Before the first step: the run's length, its checkpoint schedule, its epoch length in
        steps, the `step` it starts after and the metrics `history` it logged up to there (a
        resumed run), whether this process is rank 0 (of the world, of its node), and `any_rank`,
        whether a flag is set on any rank (a collective every rank calls); calls on_train_begin."""
        state = self.state
        state.max_steps = total_steps
        state.logging_steps = self.args.logging_steps
        state.save_steps = self.args.save_steps
        state.is_world_process_zero, state.is_local_process_zero = rank
        self.saves_at, self.steps_per_epoch, self.any_rank = saves_at, steps_per_epoch, any_rank
        state.log_history, state.best_metric = [], None
        for record in history:
            evaluated = self._record(record["step"], record)
            if evaluated is not None:
                self._track_best(record["step"], evaluated)
        state.global_step, state.epoch = step, self.epoch(step)
        self.control = TrainerControl()
        self.event("on_train_begin")

    def epoch(self, step: int) -> float | None:
        """Steps done, in epochs of the training prompts (None when the run has no epochs)."""
        return step / self.steps_per_epoch if self.steps_per_epoch else None

    def event(self, name: str, **kwargs: Any) -> None:
        """Call hook `name` of every callback; one that returns a control replaces the current one."""
        for callback in self.callbacks:
            result = getattr(callback, name)(self.args, self.state, self.control, **self.objects, **kwargs)
            if result is not None:
                self.control = result

    def begins(self, step: int) -> None:
        """Step `step` starts: on_step_begin."""
        self.control._new_step()
        self.event("on_step_begin")

    def logged(self, step: int, metrics: dict[str, float]) -> None:
        """A step's metrics were logged: the training ones, then its evaluation's (with
        on_evaluate and the best metric so far), each into log_history (with its step) and to
        on_log."""
        evaluated = self._record(step, metrics, call=True)
        if evaluated is not None:
            self._track_best(step, evaluated)

    def evaluated(self, metrics: dict[str, float], prefix: str = "eval") -> dict[str, float]:
        """An evaluation of the run's policy outside its steps (`trainer.evaluate`): its metrics
        as transformers names them, into log_history and to on_log and on_evaluate."""
        logs = {**renamed(metrics, prefix), **self._epoch()}
        self._log(self.state.global_step, logs, call=True)
        self.event("on_evaluate", metrics=logs)
        return logs

    def advanced(self, step: int, metrics: dict[str, float]) -> None:
        """A step ended: on_step_end, on_save after a scheduled checkpoint, then stop if asked on
        any rank."""
        self.state.global_step, self.state.epoch = step, self.epoch(step)
        self.event("on_step_end")
        if self.saves_at(step):
            self.event("on_save")
        if self.any_rank(bool(self.control.should_training_stop)):
            self.control.should_training_stop = True
            raise TrainingStopped(f"a callback stopped training after step {step}")

    def _record(self, step: int, metrics: dict[str, Any], call: bool = False) -> dict[str, float] | None:
        """Step `step`'s metrics into log_history: its training metrics, then its evaluation's;
        the latter, renamed, when it evaluated (with on_evaluate when `call`)."""
        self.state.global_step, self.state.epoch = step, self.epoch(step)
        trained = {name: _value(value) for name, value in metrics.items() if not _skipped(name)}
        evaluation = {name: trained.pop(name) for name in list(trained) if name.startswith(EVAL_PREFIX)}
        if trained:
            self._log(step, {**trained, **self._epoch()}, call)
        if not evaluation:
            return None
        logs = {**renamed(evaluation, "eval"), **self._epoch()}
        self._log(step, logs, call)
        if call:
            self.event("on_evaluate", metrics=logs)
        return logs

    def _log(self, step: int, logs: dict[str, float], call: bool) -> None:
        self.state.log_history.append({**logs, "step": step})
        if call:
            self.event("on_log", logs=logs)

    def _epoch(self) -> dict[str, float]:
        return {} if self.state.epoch is None else {"epoch": self.state.epoch}

    def _track_best(self, step: int, metrics: dict[str, float]) -> None:
        """state.best_metric (and its step and checkpoint) after an evaluation during training,
        as transformers' Trainer sets it after on_evaluate."""
        name = self.args.metric_for_best_model
        if name is None or name not in metrics:
            return
        value, best = metrics[name], self.state.best_metric
        better = operator.gt if self.args.greater_is_better else operator.lt
        if best is None or better(value, best):
            self.state.best_metric, self.state.best_global_step = value, step
            self.state.best_model_checkpoint = str(Path(self.args.output_dir) / "checkpoint-best")


def _skipped(name: str) -> bool:
    """Keys of a metrics.jsonl row that are not metrics."""
    return name in ("step", "time")


def _value(value: Any) -> float:
    """A logged value; a non-finite one (None in metrics.jsonl) as NaN."""
    return math.nan if value is None else value
