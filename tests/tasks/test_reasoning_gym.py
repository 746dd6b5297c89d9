"""reasoning-gym's datasets as tasks: rows by name with their options, the dataset's own scorer as
the `reasoning_gym` reward, and a run of the tiny model trained on them through the CLI's entry."""

from __future__ import annotations

import pytest

from grpoflow.cli import RECIPES
from grpoflow.data.prompts import load_rows
from grpoflow.rewards import get_reward
from grpoflow.run.build import run
from grpoflow.run.config import load_config
from grpoflow.tasks.library import import_library, parse_spec

pytest.importorskip("reasoning_gym")

SPEC = "reasoning_gym:basic_arithmetic?size=64&max_terms=2&max_digits=1"


def test_a_dataset_is_loaded_by_name_with_its_options_and_splits_differ():
    rows = load_rows(SPEC, "train", seed=42)
    assert len(rows) == 64 and rows == load_rows(SPEC, "train", seed=42)
    assert rows[0]["prompt"].startswith("Calculate") and rows[0]["metadata"]["num_terms"] == 2
    assert rows != load_rows(SPEC, "test", seed=42)
    assert load_rows(SPEC + "&seed=7", "train", seed=1) == load_rows(SPEC + "&seed=7", "test", seed=2)
    assert len(load_rows("reasoning_gym:basic_arithmetic#5", "train", seed=0)) == 5


def test_the_reward_is_the_datasets_own_scorer():
    row = load_rows(SPEC, "train", seed=0)[0]
    reward = get_reward("reasoning_gym")
    completions = [f"so <answer>{row['answer']}</answer>", row["answer"], "<answer>nonsense</answer>"]
    scores = reward(
        completions, answer=[row["answer"]] * 3, metadata=[row["metadata"]] * 3, prompts=[row["prompt"]] * 3
    )
    assert scores == [1.0, 1.0, 0.0]
    assert reward(["1"], answer=["1"], metadata=[None]) == [None]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("reasoning_gym:basic_arithmatic", "did you mean basic_arithmetic"),
        ("reasoning_gym:basic_arithmetic?colour=red", "takes no option colour .its options: .*max_terms"),
        ("reasoning_gym:basic_arithmetic?min_terms=5&max_terms=2", "refused its options: max_terms"),
        ("reasoning_gym:basic_arithmetic?size", "'size' is not an argument"),
    ],
)
def test_bad_specs_are_explained(spec, message):
    with pytest.raises(ValueError, match=message):
        load_rows(spec)


def test_a_missing_library_names_the_extra():
    with pytest.raises(ValueError, match=r"needs the some-lib package .*pip install 'grpoflow\[envs\]'"):
        import_library("grpoflow_no_such_module", "some-lib", "dataset 'x'")
    assert parse_spec("gsm8k", ("reasoning_gym",)) is None
    assert parse_spec("org/name:x", ("reasoning_gym",)) is None


def test_a_run_trains_the_tiny_model_on_a_reasoning_gym_dataset(tmp_path):
    overrides = {
        "dataset": [SPEC],
        "reward_funcs": ["reasoning_gym"],
        "num_generations": 4,
        "per_device_train_batch_size": 16,
        "max_prompt_length": 64,
        "max_completion_length": 4,
        "max_steps": 2,
        "output_dir": str(tmp_path / "run"),
        "report_to": ["none"],
        "disable_tqdm": True,
        "html_report": False,
        "save_steps": 100,
    }
    history = run(load_config(RECIPES / "default.yaml", overrides))
    assert len(history) == 2
    assert all(0.0 <= step["rewards/reasoning_gym/mean"] <= 1.0 for step in history)
