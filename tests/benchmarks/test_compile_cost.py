"""benchmarks/compile_cost.py on the CPU, tracing with the eager backend (no kernels generated):
two runs in fresh processes, a first micro-batch with as many rows as a head is wide, then others,
one graph traced each run, the table and the JSON report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import compile_cost  # noqa: E402


def test_two_runs_trace_the_layers_once_each_whatever_the_micro_batch(tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--backend", "eager", "--rows", "16", "--resized", "12"]
    report = compile_cost.main([*argv, "--length", "24", "--lora", "4", "--out", str(out)])
    assert [run["caches"] for run in report["runs"]] == ["empty", "warm"]
    for run in report["runs"]:
        assert [(call["rows"], call["length"]) for call in run["calls"]] == [
            (16, 24),
            (16, 24),
            (12, 24),
            (12, 41),
        ]
        assert run["graphs"] == 1 and run["phases"]["bytecode_tracing"] > 0
    assert json.loads(out.read_text())["runs"] == report["runs"]
    printed = capsys.readouterr().out
    assert "16x24 s" in printed and printed.count("\n") >= 4
