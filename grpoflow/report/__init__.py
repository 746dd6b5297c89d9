"""A run's report: one self-contained HTML page of its metrics' plots and sample completions,
rendered from its output directory (`grpoflow report OUTPUT_DIR`, and at the end of every run).

`run_files` reads the directory, `plots` holds the table of plots and draws them (matplotlib,
imported only to draw), `page` lays out the HTML, `writer` puts them together."""

from grpoflow.report.writer import REPORT_FILE, Report, write_at_end, write_report

__all__ = ["REPORT_FILE", "Report", "write_at_end", "write_report"]
