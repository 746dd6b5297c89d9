"""What compiling cost earlier runs of the same shapes: the first run's cost kept, a later run's
replacing the estimate of a run that finds the artifacts cached, a compiled run recording its
own from its first two steps, and a file that cannot be read or written costing only the figure."""

from __future__ import annotations

import logging

import pytest

from grpoflow.policy import compile_costs
from grpoflow.policy.compile_costs import (
    CACHED_SHARE,
    CompileCostRecorder,
    expected_seconds,
    record_seconds,
)


def test_the_first_runs_cost_then_the_cached_runs_cost(own_compile_costs):
    assert expected_seconds("shape") is None
    record_seconds("shape", 14.3)
    assert expected_seconds("shape") == pytest.approx(14.3 * CACHED_SHARE)
    record_seconds("shape", 6.0)
    assert expected_seconds("shape") == 6.0
    record_seconds("shape", 5.0)  # the latest cached run's cost; the first run's stays
    assert expected_seconds("shape") == 5.0 and expected_seconds("other") is None
    assert '"first": 14.3' in own_compile_costs.read_text()


def test_the_recorder_keeps_the_first_steps_update_less_the_seconds(own_compile_costs):
    recorder = CompileCostRecorder("shape")
    recorder(1, {"time/rollout": 1.0})  # no update timed: not counted
    recorder(7, {"time/update": 21.5})  # a resumed run's first step
    assert expected_seconds("shape") is None
    recorder(8, {"time/update": 1.5})
    recorder(9, {"time/update": 0.5})  # later steps change nothing
    assert expected_seconds("shape") == pytest.approx(20.0 * CACHED_SHARE)
    faster_first = CompileCostRecorder("warm")
    faster_first(1, {"time/update": 1.0})
    faster_first(2, {"time/update": 1.2})
    assert expected_seconds("warm") == 0.0


def test_an_unreadable_or_unwritable_file_costs_only_the_figure(
    own_compile_costs, monkeypatch, tmp_path, caplog
):
    own_compile_costs.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="grpoflow.policy.compile_costs"):
        assert expected_seconds("shape") is None
    assert any("unreadable" in r.getMessage() for r in caplog.records)
    record_seconds("shape", 3.0)  # replaces what could not be read
    assert expected_seconds("shape") == pytest.approx(3.0 * CACHED_SHARE)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setattr(compile_costs, "costs_path", lambda environ=None: blocked / "compile_seconds.json")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpoflow.policy.compile_costs"):
        record_seconds("shape", 3.0)
    assert any("not kept" in r.getMessage() for r in caplog.records)


def test_the_file_lives_in_grpoflows_cache_directory(tmp_path, monkeypatch):
    monkeypatch.undo()  # the real path, not the tests' own file
    assert (
        compile_costs.costs_path({"XDG_CACHE_HOME": str(tmp_path)})
        == tmp_path / "grpoflow" / "compile_seconds.json"
    )
