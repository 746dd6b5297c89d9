"""Writing a run's report: `grpoflow report OUTPUT_DIR`, and the end of every training run."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from grpoflow.report.page import RenderedPlot, render_page
from grpoflow.report.plots import MATPLOTLIB_HINT, PLOTS, draw_png, select_series, total_series
from grpoflow.report.run_files import read_run

logger = logging.getLogger("grpoflow")

REPORT_FILE = "report.html"
SAMPLE_STEPS = 4
"""Steps whose sample completions the report shows: the first, the last and some between."""


@dataclass(frozen=True, slots=True)
class Report:
    """A written report: where, the plots it holds and those skipped for want of metrics."""

    path: Path
    plots: tuple[str, ...]
    skipped: tuple[str, ...]

    def summary(self) -> str:
        text = f"report: {self.path} ({len(self.plots)} plots: {', '.join(self.plots)})"
        if self.skipped:
            text += f"; not logged by this run, so not plotted: {', '.join(self.skipped)}"
        return text


def write_report(output_dir: str | Path, output: str | Path | None = None) -> Report:
    """Render the report of the run in `output_dir` to `output` (default OUTPUT_DIR/report.html).
    ValueError when the directory holds no run or no logged step; ImportError without matplotlib."""
    record = read_run(output_dir)
    rendered, skipped = [], []
    for spec in PLOTS:
        series = select_series(spec, record.rows)
        if not series:
            skipped.append(spec.name)
            continue
        png = draw_png(spec, series, total_series(spec, record.rows))
        rendered.append(RenderedPlot(spec, png, tuple(series)))
    path = Path(output) if output is not None else record.output_dir / REPORT_FILE
    page = render_page(record, rendered, spread_steps(sorted(record.samples), SAMPLE_STEPS))
    _write_atomically(path, page)
    return Report(path, tuple(plot.spec.name for plot in rendered), tuple(skipped))


def write_at_end(output_dir: str | Path) -> Report | None:
    """Write the report as a run ends; any failure is logged, never raised (the run's results
    matter more than its report)."""
    try:
        report = write_report(output_dir)
    except ImportError as error:
        if MATPLOTLIB_HINT not in str(error):
            logger.warning("no run report: %s", error)
        else:
            logger.info("no run report written: %s (html_report false keeps this quiet)", MATPLOTLIB_HINT)
        return None
    except Exception as error:  # whatever it is, the run it reports has succeeded
        logger.warning("the run report could not be written: %s: %s", type(error).__name__, error)
        return None
    logger.info(report.summary())
    return report


def spread_steps(steps: list[int], count: int) -> list[int]:
    """Up to `count` of `steps` (sorted), evenly spread, the first and the last included."""
    if len(steps) <= count or count < 2:
        return list(steps[-count:]) if count > 0 else []
    last = len(steps) - 1
    return sorted({steps[round(index * last / (count - 1))] for index in range(count)})


def _write_atomically(path: Path, text: str) -> None:
    """A reader (a browser refreshing the page) never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)
