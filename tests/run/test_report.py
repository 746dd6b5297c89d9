"""The run report: a real tiny run's report parsed back (every plot a PNG), and the report of
directories written by hand (a line cut short, a resumed run's repeated steps, missing metrics,
completions that hold HTML)."""

from __future__ import annotations

import base64
import json
import logging
import struct
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
from helpers.support import recipe

from grpoflow import cli
from grpoflow.report import REPORT_FILE, write_at_end, write_report
from grpoflow.report.plots import PLOTS
from grpoflow.report.run_files import read_metrics, read_samples
from grpoflow.report.writer import spread_steps
from grpoflow.run.build import run
from grpoflow.run.failures import RunStopped
from grpoflow.run.output_dir import claim_output_dir

ALL_PLOTS = [spec.name for spec in PLOTS]
SINGLE_TURN_PLOTS = [name for name in ALL_PLOTS if not name.startswith("episode")]
"""What a run without agent episodes draws when it logs everything else."""


class ReportPage(HTMLParser):
    """The parts of a report page the tests read: its plots' images, table rows, all text."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.plots: dict[str, dict[str, str]] = {}
        self.images: dict[str, bytes] = {}
        self.summary: dict[str, list[str]] = {}
        self.sample_rows: list[list[str]] = []
        self.tags: list[str] = []
        self.text: list[str] = []
        self._figure: str | None = None
        self._table: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        self.tags.append(tag)
        if tag == "figure" and "data-plot" in attributes:
            self._figure = attributes["data-plot"]
            self.plots[self._figure] = attributes
        elif tag == "img" and self._figure is not None:
            prefix = "data:image/png;base64,"
            assert attributes["src"].startswith(prefix)
            self.images[self._figure] = base64.b64decode(attributes["src"][len(prefix) :], validate=True)
        elif tag == "table":
            self._table = attributes.get("id")
        elif tag == "tr":
            self._row = []
        elif tag == "td":
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "figure":
            self._figure = None
        elif tag == "td" and self._row is not None and self._cell is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._row:
            if self._table == "summary":
                self.summary[self._row[0]] = self._row[1:]
            elif self._table == "samples":
                self.sample_rows.append(self._row)
            self._row = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a well-formed PNG (signature, IHDR with a good CRC, IEND last)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16 : 16 + length]
    (crc,) = struct.unpack(">I", data[16 + length : 20 + length])
    assert zlib.crc32(b"IHDR" + body) == crc
    assert data[-12:] == struct.pack(">I4s", 0, b"IEND") + struct.pack(">I", zlib.crc32(b"IEND"))
    return struct.unpack(">II", body[:8])


def read_page(path: Path) -> ReportPage:
    return ReportPage(path.read_text(encoding="utf-8"))


def write_run(
    directory: Path, rows: list[dict], completions: list[dict] | None = None, tail: str = ""
) -> Path:
    """A run directory written by hand: run.json, metrics rows (then `tail`), completions."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "run.json").write_text(
        json.dumps({"run_id": "r", "config": {"model": "tiny", "max_steps": 9}})
    )
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    (directory / "metrics.jsonl").write_text(lines + tail)
    if completions is not None:
        (directory / "completions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in completions))
    return directory


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A real tiny run with KL, importance sampling, evaluation and logged completions, which
    wrote its report as it ended."""
    directory = tmp_path_factory.mktemp("report")
    config = recipe(
        directory,
        html_report=True,
        log_completions=True,
        beta=0.04,
        vllm_importance_sampling_correction=True,
        eval_dataset=["echo#8"],
        eval_strategy="steps",
        eval_steps=2,
        num_generations_eval=4,
    )
    run(config)
    return directory / "run"


@pytest.mark.slow
def test_a_finished_run_ends_with_a_report_holding_every_plot(finished_run):
    page = read_page(finished_run / REPORT_FILE)
    assert sorted(page.plots) == sorted(SINGLE_TURN_PLOTS)
    for name, data in page.images.items():
        width, height = png_size(data)
        assert width > 300 and height > 150, name
    assert "eval/pass@1" in page.plots["eval"]["data-metrics"].split()
    assert "memory/max_rss_gib" in page.plots["memory"]["data-metrics"].split()
    phases = page.plots["time_per_phase"]["data-metrics"].split()
    assert {"time/rollout", "time/reward", "time/update", "time/other"} <= set(phases)
    first_step, _, last_step, _ = page.summary["reward"]
    assert (first_step, last_step) == ("1", "4")
    assert "model tiny" in "".join(page.text) and "step 4 of 4" in "".join(page.text)
    steps = [row[0] for row in page.sample_rows]
    assert sorted(set(steps)) == ["1", "2", "3", "4"] and steps.count("1") == 6
    advantages = [float(row[1]) for row in page.sample_rows if row[0] == "1"]
    assert advantages[0] == max(advantages) and advantages[-1] == min(advantages)


@pytest.mark.slow
def test_grpoflow_report_writes_where_asked_and_says_what_it_drew(finished_run, tmp_path, capsys):
    output = tmp_path / "elsewhere" / "page.html"
    assert cli.main(["report", str(finished_run), "--output", str(output)]) == 0
    said = capsys.readouterr().out
    assert str(output) in said and f"{len(SINGLE_TURN_PLOTS)} plots" in said
    assert sorted(read_page(output).plots) == sorted(SINGLE_TURN_PLOTS)


def test_grpoflow_report_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    message = capsys.readouterr().err
    assert "is not a run's output directory" in message and "grpoflow train" in message
    (tmp_path / "run.json").write_text("{}")
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no logged step yet" in capsys.readouterr().err


@pytest.mark.slow
def test_html_report_false_writes_none_and_the_run_records_its_settings(tmp_path):
    run(recipe(tmp_path, max_steps=1))
    assert not (tmp_path / "run" / REPORT_FILE).exists()
    settings = json.loads((tmp_path / "run" / "run.json").read_text())["config"]
    assert settings["html_report"] is False and settings["model"] == "tiny"


@pytest.mark.slow
def test_a_run_stopped_early_still_gets_its_report(tmp_path):
    plugin = tmp_path / "plugin.py"
    plugin.write_text("def broken(completions, **kwargs):\n    raise RuntimeError('down')\n")
    config = recipe(
        tmp_path,
        html_report=True,
        reward_funcs=["echo", f"{plugin}:broken"],
        max_consecutive_reward_failures=2,
    )
    with pytest.raises(RunStopped):
        run(config)
    page = read_page(tmp_path / "run" / REPORT_FILE)
    assert page.summary["reward"][2] == "2" and "grad_norm" in page.plots


def test_a_new_run_in_the_directory_discards_the_old_report(tmp_path):
    directory = write_run(tmp_path / "run", [{"step": 1, "reward": 0.5}])
    (directory / REPORT_FILE).write_text("<html></html>")
    claim = claim_output_dir(directory, None, overwrite=True)
    assert directory / REPORT_FILE in claim.discard


def test_a_line_cut_short_by_a_running_run_is_skipped(tmp_path):
    rows = [{"step": step, "time": 100.0 + step, "reward": step / 10} for step in (1, 2, 3)]
    directory = write_run(tmp_path / "run", rows, tail='{"step": 4, "reward": 0.')
    report = write_report(directory)
    assert report.plots == ("reward",)
    page = read_page(report.path)
    assert page.summary["reward"] == ["1", "0.1", "3", "0.3"]
    assert "1 unreadable metrics line(s) skipped" in "".join(page.text)


def test_a_resumed_runs_repeated_steps_keep_the_last(tmp_path):
    values = [(1, 0.1), (2, 0.2), (3, 0.3), (2, 0.25), (3, 0.35), (4, 0.4)]
    rows, _ = read_metrics(
        write_run(tmp_path, [{"step": s, "reward": r} for s, r in values]) / "metrics.jsonl"
    )
    assert [(row["step"], row["reward"]) for row in rows] == [(1, 0.1), (2, 0.25), (3, 0.35), (4, 0.4)]
    logged = [(2, 0.5, "first"), (3, 0.1, "first"), (2, -0.5, "again"), (2, 0.9, "again")]
    path = tmp_path / "completions.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s, "advantage": a, "completion": c}) + "\n" for s, a, c in logged)
    )
    samples = read_samples(path, per_side=2)
    assert [(s.advantage, s.completion) for s in samples[2]] == [(0.9, "again"), (-0.5, "again")]


def test_missing_metrics_skip_their_plots(tmp_path):
    rows = [
        {"step": step, "reward": 0.5, "loss": None if step == 2 else 0.1, "kl": None} for step in (1, 2, 3)
    ]
    report = write_report(write_run(tmp_path, rows))
    assert report.plots == ("reward", "loss")
    assert set(report.skipped) == set(ALL_PLOTS) - {"reward", "loss"}
    page = read_page(report.path)
    assert sorted(page.plots) == ["loss", "reward"]
    assert page.summary["loss"] == ["1", "0.1", "3", "0.1"]  # the step without it left out
    assert "logged no completions" in "".join(page.text)


def test_eval_metrics_get_the_eval_plot_with_the_scores_only(tmp_path):
    rows = [{"step": step, "reward": 0.1} for step in (1, 2, 3, 4)]
    rows[1].update({"eval/reward": 0.2, "eval/pass@1": 0.1, "eval/pass@2": 0.2, "eval/time": 3.0})
    rows[3].update({"eval/reward": 0.4, "eval/pass@1": 0.3, "eval/pass@2": 0.5, "eval/time": 3.0})
    report = write_report(write_run(tmp_path, rows))
    assert report.plots == ("reward", "eval")
    page = read_page(report.path)
    assert page.plots["eval"]["data-metrics"].split() == ["eval/reward", "eval/pass@1", "eval/pass@2"]
    assert page.summary["eval/pass@2"] == ["2", "0.2", "4", "0.5"]


def test_the_samples_table_escapes_what_the_policy_wrote(tmp_path):
    attack = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    completions = [
        {"step": 1, "prompt": "echo <b>", "completion": attack, "rewards": {"echo": 1.0}, "advantage": 1.0},
        {"step": 1, "prompt": "echo &", "completion": "plain", "rewards": {"echo": None}, "advantage": -1.0},
    ]
    report = write_report(write_run(tmp_path, [{"step": 1, "reward": 0.5}], completions))
    page = read_page(report.path)
    assert "script" not in page.tags and page.tags.count("img") == len(report.plots)
    assert page.sample_rows[0][3:] == ["echo <b>", attack]
    assert page.sample_rows[1][2:4] == ["echo –", "echo &"]


def test_agent_episodes_get_their_plots_and_whole_conversations_in_the_samples(tmp_path):
    rows = [
        {"step": step, "reward": 0.5, "episodes/turns_mean": 3.0, "episodes/segments_mean": 1.0}
        | {"episodes/ended_by/stop": 0.75, "episodes/ended_by/length": 0.25}
        for step in (1, 2)
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"query": "cat"}'}}
    conversation = [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "cat: a word"},
        {"role": "assistant", "content": "x" * 3000 + " A cat is an animal."},
    ]
    completion = {"step": 1, "prompt": "Define cat.", "completion": "A cat is an animal.", "advantage": 1.0}
    completions = [completion | {"rewards": {"agent": 1.0}, "conversation": conversation}]
    report = write_report(write_run(tmp_path, rows, completions))
    assert report.plots == ("reward", "episodes", "episode_endings")
    page = read_page(report.path)
    assert page.plots["episodes"]["data-metrics"].split() == ["episodes/turns_mean", "episodes/segments_mean"]
    shown = page.sample_rows[0][4]
    assert shown.startswith(
        'assistant: Let me look.\n  -> lookup({"query": "cat"})\ntool: cat: a word\nassistant: x'
    )
    assert shown.endswith(" A cat is an animal.") and "characters] …" in shown  # cut in the middle


def test_without_matplotlib_the_run_says_how_to_get_its_report(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    directory = write_run(tmp_path, [{"step": 1, "reward": 0.5}])
    with caplog.at_level(logging.INFO, logger="grpoflow"):
        assert write_at_end(directory) is None
    assert "pip install 'grpoflow[report]'" in caplog.text
    assert not (directory / REPORT_FILE).exists()


def test_a_report_that_cannot_be_written_is_logged_not_raised(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="grpoflow"):
        assert write_at_end(tmp_path / "missing") is None
    assert "the run report could not be written" in caplog.text


def test_sample_steps_spread_from_first_to_last():
    assert spread_steps(list(range(1, 11)), 4) == [1, 4, 7, 10]
    assert spread_steps([3, 5], 4) == [3, 5]
    assert spread_steps([], 4) == []
