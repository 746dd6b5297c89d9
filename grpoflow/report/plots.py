"""The report's plots: a table of what each plot shows, and drawing one as a PNG.

Each `PlotSpec` names the metrics it draws by pattern (`rewards/*/mean`), so a plot follows
whatever reward functions, phases or eval metrics a run logged; a plot none of whose metrics
the run logged is skipped. matplotlib is imported only to draw, through its Agg canvas (no
display, no pyplot state), so a report renders on any machine and in any thread.
"""

from __future__ import annotations

import fnmatch
import io
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

MATPLOTLIB_HINT = "the run report needs matplotlib: pip install 'grpoflow[report]'"


TIME_NOT_IN_STEP = ("time/step", "time/environment", "time/agent", "time/background/*")
"""`time/...` metrics that are not one of the phases a step's seconds add up from."""


@dataclass(frozen=True, slots=True)
class PlotSpec:
    """One plot: the metrics it draws (glob patterns over metric names, in order) and how."""

    name: str
    """Stable id of the plot (the page marks its element with it)."""
    title: str
    metrics: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    ylabel: str = ""
    style: Literal["lines", "stacked"] = "lines"
    """lines: one line per metric; stacked: areas stacked per step (parts of a whole)."""
    total: str | None = None
    """A metric drawn as a line over a stack: the whole its parts add up to (or overlap in)."""


@dataclass(frozen=True, slots=True)
class Series:
    """One metric's logged values: steps and values, the steps where it is missing left out."""

    name: str
    steps: tuple[int, ...]
    values: tuple[float, ...]


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("reward", "Reward (weighted sum)", ("reward",), ylabel="mean reward"),
    PlotSpec("rewards", "Reward per function", ("rewards/*/mean",), ylabel="mean reward"),
    PlotSpec(
        "eval",
        "Evaluation",
        ("eval/reward", "eval/rewards/*/mean", "eval/pass@*", "eval/maj@*", "eval/avg@*"),
        ylabel="score",
    ),
    PlotSpec("kl", "KL to the reference model", ("kl",), ylabel="nats per token"),
    PlotSpec("entropy", "Entropy", ("entropy",), ylabel="nats per token"),
    PlotSpec(
        "completion_length",
        "Completion length",
        ("completions/mean_length", "completions/max_length"),
        ylabel="tokens",
    ),
    PlotSpec("clip_ratio", "Clipped token ratios", ("clip_ratio/*",), ylabel="fraction of tokens"),
    PlotSpec(
        "importance_ratio",
        "Importance-sampling ratio (trainer / sampler)",
        ("sampling/importance_sampling_ratio/*",),
        ylabel="ratio",
    ),
    PlotSpec(
        "logprob_gap",
        "Sampler to trainer log-prob gap",
        ("sampling/sampling_logp_difference/*",),
        ylabel="nats per token",
    ),
    PlotSpec(
        "episodes",
        "Agent episodes",
        (
            "episodes/turns_mean",
            "episodes/tool_calls_mean",
            "episodes/tool_errors_mean",
            "episodes/segments_mean",
            "episodes/dropped_turns_mean",
        ),
        ylabel="per episode",
    ),
    PlotSpec(
        "episode_endings",
        "How episodes ended",
        ("episodes/ended_by/*",),
        ylabel="fraction of episodes",
        style="stacked",
    ),
    PlotSpec("loss", "Loss", ("loss",)),
    PlotSpec("grad_norm", "Gradient norm (before clipping)", ("grad_norm",)),
    PlotSpec("learning_rate", "Learning rate", ("learning_rate",)),
    PlotSpec(
        "time_per_phase",
        "Seconds per step, by phase",
        ("time/*",),
        # Each phase's own seconds stack up to time/step, drawn as a line (time/other: seconds in
        # no phase). time/environment and time/agent are spent inside time/rollout, and
        # time/background/* (async_generate) in another thread, overlapping the step.
        exclude=TIME_NOT_IN_STEP,
        ylabel="seconds",
        style="stacked",
        total="time/step",
    ),
    PlotSpec("tokens_per_second", "Throughput", ("tokens_per_second/*",), ylabel="tokens / s"),
    PlotSpec("memory", "Peak memory", ("memory/*",), ylabel="GiB"),
)
"""Every plot a report may hold, in page order."""


def select_series(spec: PlotSpec, rows: Sequence[dict[str, Any]]) -> list[Series]:
    """The series of `rows` (metrics rows in step order) that `spec` draws, in pattern order;
    metrics never logged with a number are left out."""
    names = [
        name
        for name in _metric_names(rows)
        if not any(fnmatch.fnmatchcase(name, excluded) for excluded in spec.exclude)
    ]
    chosen: list[str] = []
    for pattern in spec.metrics:
        chosen += [name for name in names if fnmatch.fnmatchcase(name, pattern) and name not in chosen]
    series = [_series(name, rows) for name in chosen]
    return [item for item in series if item.steps]


def total_series(spec: PlotSpec, rows: Sequence[dict[str, Any]]) -> Series | None:
    """The series of `spec.total` in `rows`; None when the spec has none or it was never logged."""
    if spec.total is None:
        return None
    series = _series(spec.total, rows)
    return series if series.steps else None


def draw_png(spec: PlotSpec, series: Sequence[Series], total: Series | None = None) -> bytes:
    """The plot as PNG bytes (ImportError naming the extra when matplotlib is missing); `total`
    is the series of `spec.total`, drawn over the others."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(MATPLOTLIB_HINT) from error
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(6.4, 3.4), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    DRAWERS[spec.style](axes, series, labels(item.name for item in series))
    if total is not None and total.steps:
        axes.plot(
            total.steps, total.values, color="black", linewidth=1.0, label=total.name.rpartition("/")[2]
        )
    axes.set_title(spec.title, fontsize=11)
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if spec.ylabel:
        axes.set_ylabel(spec.ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="best")  # names the metric even when one is drawn (memory/...)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _draw_lines(axes, series: Sequence[Series], names: Sequence[str]) -> None:
    for item, name in zip(series, names):
        # A sparse series (evaluation every few steps) reads better with its points marked.
        marker = "o" if len(item.steps) <= 30 else None
        axes.plot(item.steps, item.values, label=name, marker=marker, markersize=3, linewidth=1.2)


def _draw_stacked(axes, series: Sequence[Series], names: Sequence[str]) -> None:
    steps = sorted({step for item in series for step in item.steps})
    layers = []
    for item in series:
        by_step = dict(zip(item.steps, item.values))
        layers.append([by_step.get(step, 0.0) for step in steps])
    axes.stackplot(steps, *layers, labels=list(names), alpha=0.85)


DRAWERS = {"lines": _draw_lines, "stacked": _draw_stacked}


def labels(names: Iterable[str]) -> list[str]:
    """Legend labels: the metric names less the folders they all share (`time/rollout` and
    `time/update` read `rollout`, `update`)."""
    names = list(names)
    shared = os.path.commonprefix(names)
    cut = shared.rfind("/") + 1 if len(names) > 1 else 0
    return [name[cut:] or name for name in names]


def _metric_names(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Every metric name logged in `rows`, sorted (so a plot's lines keep one order)."""
    return sorted({name for row in rows for name in row if name not in ("step", "time")})


def _series(name: str, rows: Sequence[dict[str, Any]]) -> Series:
    points = [
        (row["step"], float(row[name]))
        for row in rows
        if isinstance(row.get(name), int | float) and not isinstance(row.get(name), bool)
    ]
    return Series(name, tuple(step for step, _ in points), tuple(value for _, value in points))
