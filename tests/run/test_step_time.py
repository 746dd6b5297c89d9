"""Every second of a training step falls in a named `time/...` phase: the phases add up to
`time/step` (CPU runs of the embedded default through the trainer)."""

from __future__ import annotations

import pytest
from helpers.support import read_jsonl, recipe

from grpoflow.report.plots import TIME_NOT_IN_STEP
from grpoflow.run.build import run

TOLERANCE = 0.02
"""The phases' sum may miss time/step by 2% of it..."""
FLOOR_SECONDS = 0.02
"""...or by 20 ms, whichever is larger: a tiny CPU step takes a few hundred milliseconds, and on a
shared machine the scheduler can stall the Python between two phases for a few milliseconds."""


def step_phases(row: dict) -> dict[str, float]:
    """The phases of a logged step that add up to its time/step (time/other, the remainder, left out)."""
    excluded = {name for name in TIME_NOT_IN_STEP if not name.endswith("*")} | {"time/other"}
    return {
        name: value
        for name, value in row.items()
        if name.startswith("time/") and name not in excluded and not name.startswith("time/background/")
    }


def assert_phases_add_up(rows: list[dict]) -> None:
    for row in rows:
        phases, total = step_phases(row), row["time/step"]
        assert abs(sum(phases.values()) - total) <= max(TOLERANCE * total, FLOOR_SECONDS), (
            row["step"],
            phases,
        )
        assert row["time/other"] == pytest.approx(total - sum(phases.values()), abs=1e-6)


def test_full_run_with_reference_and_checkpoints_adds_up(tmp_path):
    config = recipe(tmp_path, max_steps=3, save_steps=2, beta=0.05, num_iterations=2)
    run(config)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert_phases_add_up(rows)
    assert [row.get("time/checkpoint", 0.0) > 0 for row in rows] == [False, True, True]  # steps 2 and 3 save
    for name in ("time/rollout", "time/reward", "time/update", "time/reference", "time/old_logprobs"):
        assert all(row[name] > 0 for row in rows), name
    assert rows[0]["time/log"] == 0.0 and all(row["time/log"] > 0 for row in rows[1:])


def test_lora_runs_add_up_and_only_an_engine_that_needs_merged_weights_merges(tmp_path):
    pytest.importorskip("peft")
    run(recipe(tmp_path / "native", max_steps=2, train_type="lora", beta=0.05))
    rows = read_jsonl(tmp_path / "native" / "run" / "metrics.jsonl")
    assert_phases_add_up(rows)
    assert not any("time/merge" in row for row in rows)  # the native engine applies the adapters
    run(recipe(tmp_path / "hf", max_steps=2, train_type="lora", rollout_engine="hf"))
    rows = read_jsonl(tmp_path / "hf" / "run" / "metrics.jsonl")
    assert_phases_add_up(rows)
    assert all(row["time/merge"] > 0 and row["time/unmerge"] > 0 for row in rows)


def test_offloaded_reference_charges_its_moves(tmp_path):
    run(recipe(tmp_path, max_steps=2, beta=0.05, offload_model=True, offload_optimizer=True))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert_phases_add_up(rows)
    assert all(row["time/offload"] > 0 and row["time/reload"] > 0 for row in rows)  # the reference's moves
