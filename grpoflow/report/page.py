"""The report as one self-contained HTML page: a heading naming the run, a table of each plotted
metric's first and last values, the plots (PNG embedded as base64, each in a `<figure>` whose
`data-plot` names it) and a table of sample completions. Every text from the run is escaped."""

from __future__ import annotations

import base64
import html
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grpoflow.report.plots import PlotSpec, Series
from grpoflow.report.run_files import RunRecord, Sample

MAX_TEXT = 2000
"""Characters of a prompt or completion shown in the samples table (the rest is cut)."""

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; color: #222; }
h1 { margin-bottom: 0.2em; } .meta { color: #555; margin-top: 0; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; }
figure.plot { margin: 0; border: 1px solid #ddd; padding: 0.4em; }
figure.plot img { display: block; width: 640px; max-width: 100%; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; max-width: 60em; }
"""


@dataclass(frozen=True, slots=True)
class RenderedPlot:
    """A drawn plot: its spec, its PNG and the series it shows."""

    spec: PlotSpec
    png: bytes
    series: tuple[Series, ...]


def render_page(record: RunRecord, plots: Sequence[RenderedPlot], sample_steps: Sequence[int]) -> str:
    """The HTML page of `record` with `plots`, showing the samples of `sample_steps`."""
    name = record.output_dir.resolve().name
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>grpoflow run report: {_text(name)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>Run report: {_text(name)}</h1>",
        f'<p class="meta" id="run-meta">{_text(" · ".join(describe_run(record)))}</p>',
        _summary_table(plots),
        '<h2>Plots</h2><div class="plots">',
        *(_figure(plot) for plot in plots),
        "</div>",
        _samples_section(record, sample_steps),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def describe_run(record: RunRecord) -> list[str]:
    """The heading's facts: model, datasets, steps logged (of the planned), time span."""
    settings = record.settings
    facts = [f"output_dir {record.output_dir}"]
    if settings.get("model"):
        facts.append(f"model {settings['model']}")
    if settings.get("dataset"):
        datasets = settings["dataset"]
        facts.append(f"dataset {', '.join(map(str, datasets)) if isinstance(datasets, list) else datasets}")
    last_step = record.rows[-1]["step"]
    planned = settings.get("max_steps")
    facts.append(
        f"step {last_step} of {planned}" if isinstance(planned, int) and planned > 0 else f"step {last_step}"
    )
    if record.info.get("started"):
        facts.append(f"started {record.info['started']}")
    times = [row["time"] for row in record.rows if isinstance(row.get("time"), int | float)]
    if times:
        span = max(times) - min(times) + float(record.rows[0].get("time/step") or 0.0)
        facts.append(
            f"{_duration(span)} logged, last at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(max(times)))}"
        )
    if record.skipped_lines:
        facts.append(f"{record.skipped_lines} unreadable metrics line(s) skipped")
    return facts


def _summary_table(plots: Sequence[RenderedPlot]) -> str:
    rows = []
    for plot in plots:
        for item in plot.series:
            rows.append(
                f'<tr data-metric="{_text(item.name)}"><td>{_text(item.name)}</td>'
                f'<td class="num">{item.steps[0]}</td><td class="num">{_number(item.values[0])}</td>'
                f'<td class="num">{item.steps[-1]}</td><td class="num">{_number(item.values[-1])}</td></tr>'
            )
    header = "<tr><th>metric</th><th>first step</th><th>first</th><th>last step</th><th>last</th></tr>"
    return f'<h2>Summary</h2><table id="summary">{header}{"".join(rows)}</table>'


def _figure(plot: RenderedPlot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    name, title = _text(plot.spec.name), _text(plot.spec.title)
    metrics = _text(" ".join(item.name for item in plot.series))
    return (
        f'<figure class="plot" id="plot-{name}" data-plot="{name}" data-metrics="{metrics}">'
        f'<img alt="{title}" src="data:image/png;base64,{data}"><figcaption>{title}</figcaption></figure>'
    )


def _samples_section(record: RunRecord, steps: Sequence[int]) -> str:
    if not steps:
        return (
            '<h2>Sample completions</h2><p id="samples">This run logged no completions '
            "(log_completions: true logs them).</p>"
        )
    header = "<tr><th>step</th><th>advantage</th><th>rewards</th><th>prompt</th><th>completion</th></tr>"
    rows = [_sample_row(sample) for step in steps for sample in record.samples[step]]
    caption = "The highest- and lowest-advantage completions of a few steps."
    return f'<h2>Sample completions</h2><p>{caption}</p><table id="samples">{header}{"".join(rows)}</table>'


def _sample_row(sample: Sample) -> str:
    rewards = ", ".join(f"{name} {_number(value)}" for name, value in sample.rewards.items())
    return (
        f'<tr data-step="{sample.step}"><td class="num">{sample.step}</td>'
        f'<td class="num">{_number(sample.advantage)}</td><td>{_text(rewards)}</td>'
        f"<td><pre>{_text(_cut(sample.prompt))}</pre></td><td><pre>{_text(_cut(sample.completion))}</pre></td></tr>"
    )


def _cut(text: str) -> str:
    """`text`, or its first and last parts around a note of what was cut (an episode's end is
    where it was decided)."""
    if len(text) <= MAX_TEXT:
        return text
    head, tail = MAX_TEXT * 3 // 5, MAX_TEXT * 2 // 5
    return f"{text[:head]} … [{len(text) - head - tail} characters] … {text[-tail:]}"


def _text(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _number(value: float | None) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"
