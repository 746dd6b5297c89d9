"""benchmarks/moe_rollout.py runs on the CPU (a tiny Qwen3-MoE model) and writes its report."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from helpers.native_fixtures import one_thread  # noqa: F401 (a fixture)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_rollout.py"


@pytest.mark.slow
def test_both_paths_generate_every_token_and_the_report_has_a_row_each(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("moe_rollout_benchmark", SCRIPT)
    benchmark = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, benchmark)
    spec.loader.exec_module(benchmark)
    output = tmp_path / "report.json"
    benchmark.main(["--device", "cpu", "--tiny", "--output", str(output)])
    report = json.loads(output.read_text())
    assert [row["path"] for row in report["rows"]] == ["family", "generic"]
    for row in report["rows"]:
        assert row["layers"] == 2 and row["tokens"] == 4 * 2 * 8 and row["tokens_per_s"] > 0
        assert "roofline_fraction" in row
    assert report["decode_bytes"]["sparse_layers"] == 2 and report["family_over_generic"] > 0
