"""benchmarks/join_prefills.py runs on the CPU and writes its report: agent turns that may wait
for others share prefill steps, every turn is answered."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "join_prefills.py"


def test_turns_that_wait_for_others_take_fewer_prefill_steps(tmp_path):
    spec = importlib.util.spec_from_file_location("join_prefills_benchmark", SCRIPT)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    output = tmp_path / "report.json"
    threads = torch.get_num_threads()
    try:  # the benchmark runs on one thread; later tests (vLLM on the CPU) need theirs back
        benchmark.main(
            ["--episodes", "16", "--turns", "2", "--rows", "16", "--layers", "2", "--wait-steps", "0,8"]
            + ["--output", str(output)]
        )
    finally:
        torch.set_num_threads(threads)
    eager, waiting = json.loads(output.read_text())["rows"]
    assert waiting["prefill_steps"] < eager["prefill_steps"]
    assert waiting["steps_to_answer_max"] <= eager["steps_to_answer_max"] + 8
