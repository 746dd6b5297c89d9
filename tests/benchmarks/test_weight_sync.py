"""benchmarks/weight_sync.py runs end to end on the CPU (a tiny model, gloo) and writes its report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "weight_sync.py"


@pytest.mark.slow
def test_the_benchmark_times_both_transports_and_checks_the_weights(tmp_path):
    spec = importlib.util.spec_from_file_location("weight_sync_benchmark", SCRIPT)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    output = tmp_path / "report.json"
    benchmark.main(["--device", "cpu", "--warmup", "1", "--repeats", "2", "--output", str(output)])
    report = json.loads(output.read_text())
    assert report["device"] == "cpu" and report["model"] == "random:tiny"
    by_transport = {result["transport"]: result for result in report["results"]}
    assert (
        set(by_transport) == {"collective", "checkpoint"} and by_transport["collective"]["backend"] == "gloo"
    )
    for result in report["results"]:
        assert len(result["times_ms"]) == 2 and 0 < result["min_ms"] <= result["median_ms"]
        assert result["check_logprob_gap"] < 1e-3  # the server holds the trainer's weights
