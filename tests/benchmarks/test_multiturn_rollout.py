"""benchmarks/multiturn_rollout.py runs on the CPU (a tiny model) and writes its report."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "multiturn_rollout.py"


@pytest.mark.slow
def test_the_prefix_cache_saves_prefill_and_keeps_every_episode(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    spec = importlib.util.spec_from_file_location("multiturn_rollout_benchmark", SCRIPT)
    benchmark = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, benchmark)  # its dataclasses look their module up
    spec.loader.exec_module(benchmark)
    output = tmp_path / "report.json"
    benchmark.main(
        ["--device", "cpu", "--preset", "tiny", "--prompts", "3", "--samples", "2", "--turns", "3"]
        + ["--prompt-tokens", "40", "--turn-tokens", "12", "--env-tokens", "10", "--output", str(output)]
    )
    report = json.loads(output.read_text())
    cached, plain = report["prefix_caching"], report["no_prefix_caching"]
    assert report["prefill_tokens_saved"] > 0 and report["matching_episodes"] == 1.0
    assert plain["prefix_cache_hit_tokens"] == 0
    for run in (cached, plain):
        assert [turn["turn"] for turn in run["turns"]] == [1, 2, 3]
        assert run["generated_tokens"] == 3 * 6 * 12
        for turn in run["turns"]:  # each turn's prompt tokens are either prefilled or cached
            assert turn["prefill_tokens"] + turn["prefix_cache_hit_tokens"] == turn["prompt_tokens"]
    assert [turn["prompt_tokens"] for turn in cached["turns"]] == [
        turn["prompt_tokens"] for turn in plain["turns"]
    ]
    assert cached["prefill_tokens"] + cached["prefix_cache_hit_tokens"] == plain["prefill_tokens"]
