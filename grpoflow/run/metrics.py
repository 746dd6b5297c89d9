"""Where metrics go: metrics.jsonl always, TensorBoard and wandb when asked, a live progress bar,
and completions.jsonl with every completion, its rewards and its advantage."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from grpoflow.options import require

logger = logging.getLogger("grpoflow")


@dataclass(kw_only=True, slots=True)
class LogConfig:
    """What gets logged where."""

    logging_steps: int = 1
    """Log metrics every this many steps."""
    log_completions: bool = False
    """Write every completion with its rewards and advantage to completions.jsonl."""
    report_to: list[Literal["tensorboard", "wandb", "none", "all"]] = field(
        default_factory=lambda: ["tensorboard"]
    )
    """Metric sinks besides metrics.jsonl."""
    disable_tqdm: bool = False
    """Turn off the live progress bar."""
    html_report: bool = True
    """Write report.html (plots of the metrics, sample completions) into output_dir when the run
    ends; needs matplotlib (pip install 'grpoflow[report]'). `grpoflow report` writes it any time."""

    def __post_init__(self) -> None:
        require(self.logging_steps > 0, "logging_steps", "> 0", self.logging_steps)


class StepListener(Protocol):
    """Code of the user's that follows the run's steps (the Python API's callbacks)."""

    def begins(self, step: int) -> None:
        """Step `step` starts."""

    def logged(self, step: int, metrics: dict[str, float]) -> None:
        """Step `step`'s metrics were written to the sinks."""

    def advanced(self, step: int, metrics: dict[str, float]) -> None:
        """Step `step` ended (logged or not), with its metrics."""


class MetricsLogger:
    """Fan step metrics out to the configured sinks, and to a listener when one is given."""

    def __init__(
        self,
        output_dir: str | Path,
        *,
        report_to: Sequence[str],
        total_steps: int,
        start_step: int = 0,
        show_progress: bool = True,
        run_config: dict[str, Any] | None = None,
        listener: StepListener | None = None,
    ) -> None:
        self.output_dir, self.start_step = Path(output_dir), start_step
        self.listener = listener
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_file = open(self.output_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.completions_file = None
        sinks = set(report_to)
        if "all" in sinks:
            sinks = {"tensorboard", "wandb"}
        self.tensorboard = self._open_tensorboard() if "tensorboard" in sinks else None
        self.wandb = self._open_wandb(run_config) if "wandb" in sinks else None
        self.progress = None
        self._redirect = contextlib.ExitStack()
        if show_progress:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.progress = tqdm(total=total_steps, initial=start_step, desc="grpo", unit="step")
            # Log lines print above the bar instead of into its line.
            self._redirect.enter_context(logging_redirect_tqdm())

    def _open_tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            # TensorBoard is the default sink and an optional extra: without it, say so once, quietly.
            logger.info(
                "TensorBoard is not installed, so metrics go to %s only (for TensorBoard: pip install "
                "'grpoflow[logging]'; report_to none keeps this quiet)",
                self.output_dir / "metrics.jsonl",
            )
            return None
        # A resumed run's events replace those logged after its checkpoint.
        purge_step = self.start_step + 1 if self.start_step else None
        return SummaryWriter(log_dir=str(self.output_dir / "runs"), flush_secs=10, purge_step=purge_step)

    def _open_wandb(self, run_config):
        try:
            import wandb
        except ImportError:
            logger.warning("report_to wandb ignored: wandb is not installed (pip install wandb)")
            return None
        return wandb.init(project="grpoflow", config=run_config, dir=str(self.output_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {name: _finite(value) for name, value in metrics.items()}
        record = {"step": step, "time": round(time.time(), 3), **clean}
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        if self.tensorboard is not None:
            for name, value in clean.items():
                if value is not None:
                    self.tensorboard.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if self.listener is not None:
            self.listener.logged(step, metrics)

    def begin(self, step: int) -> None:
        """Step `step` starts: tell the listener."""
        if self.listener is not None:
            self.listener.begins(step)

    def advance(self, step: int, metrics: dict[str, float]) -> None:
        """Move the progress bar to `step`, showing the latest reward; tell the listener."""
        if self.listener is not None:
            self.listener.advanced(step, metrics)
        if self.progress is None:
            return
        self.progress.update(step - self.progress.n)
        shown = {key: metrics[key] for key in ("reward", "kl", "time/step") if key in metrics}
        self.progress.set_postfix({key: f"{value:.3f}" for key, value in shown.items()})

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        if self.completions_file is None:
            path = self.output_dir / "completions.jsonl"
            self.completions_file = open(path, "a", encoding="utf-8")  # noqa: SIM115
        for row in rows:
            self.completions_file.write(json.dumps({"step": step, **row}, default=str) + "\n")
        self.completions_file.flush()

    def close(self) -> None:
        for handle in (self.metrics_file, self.completions_file):
            if handle is not None:
                handle.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.progress is not None:
            self._redirect.close()
            self.progress.close()


class ListenerRelay:
    """The steps of a rank other than 0, told to its listener alone: rank 0 writes the metrics
    (averaged over ranks, so every rank holds the same), while the Python API's callbacks run on
    every rank, as transformers' Trainer calls them."""

    def __init__(self, listener: StepListener) -> None:
        self.listener = listener

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.listener.logged(step, metrics)

    def begin(self, step: int) -> None:
        self.listener.begins(step)

    def advance(self, step: int, metrics: dict[str, float]) -> None:
        self.listener.advanced(step, metrics)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Rank 0 writes the completions of every rank; nothing to do here."""

    def close(self) -> None:
        """Nothing is open."""


StepLog = MetricsLogger | ListenerRelay
"""Where the training loop reports its steps: rank 0's logger, or another rank's relay."""


def _finite(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None
