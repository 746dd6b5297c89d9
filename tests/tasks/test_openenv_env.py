"""OpenEnv environments run in process by name: the first observation after the prompt, each turn
as the environment's action, each observation back to the policy until done, the sum of the step
rewards as the episode's reward, and a run of the tiny model through the CLI's entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpoflow.cli import RECIPES
from grpoflow.data.prompts import load_rows
from grpoflow.run.build import run
from grpoflow.run.config import load_config
from grpoflow.tasks import library_environment

pytest.importorskip("openenv.core.env_server")

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
SPEC = f"openenv:{HELPERS / 'openenv_letters.py'}:LetterEnvironment"


def test_rows_carry_the_prompt_and_a_seed_each():
    assert load_rows(SPEC + "?size=3&prompt=go") == [
        {"prompt": "go", "openenv_seed": seed} for seed in range(3)
    ]
    assert load_rows(SPEC + "?size=1") == [{"prompt": "LetterEnvironment environment", "openenv_seed": 0}]


def test_an_episode_steps_the_environment_until_done_and_sums_its_rewards():
    environment = library_environment(SPEC + "?turns=2")()
    assert environment.reset(openenv_seed=2, prompt="go") == "\necho c:"
    assert environment.respond("cccc") == "echo d:"
    assert environment.respond("ddxx") is None  # done after two steps
    assert environment.get_reward() == 1.5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (SPEC + "?colour=red", "LetterEnvironment cannot be built: .*colour"),
        (SPEC + "?action_field=words", "LetterAction has no field 'words' .its fields: message"),
        (f"openenv:{HELPERS / 'openenv_letters.py'}:LetterAction", "is not an OpenEnv Environment class"),
        ("openenv:no_such_module_anywhere:Env", "no_such_module_anywhere"),
    ],
)
def test_bad_specs_are_explained(spec, message):
    with pytest.raises(ValueError, match=message):
        library_environment(spec)().reset(openenv_seed=0)


def test_a_run_trains_on_an_openenv_environment_by_name(tmp_path):
    overrides = {
        "environment": SPEC + "?size=32&prompt=go&turns=2",
        "dataset": [],
        "reward_funcs": [],
        "num_generations": 4,
        "per_device_train_batch_size": 16,
        "max_prompt_length": 16,
        "max_turn_tokens": 4,
        "max_completion_length": 24,
        "max_steps": 2,
        "output_dir": str(tmp_path / "run"),
        "report_to": ["none"],
        "disable_tqdm": True,
        "html_report": False,
        "log_completions": True,
        "save_steps": 100,
    }
    history = run(load_config(RECIPES / "default.yaml", overrides))
    step = history[-1]
    assert step["episodes/turns_mean"] == 2.0 and step["episodes/ended_by/stop"] == 1.0
    assert 0.0 <= step["rewards/OpenEnvEnvironment/mean"] <= 2.0
    row = json.loads((tmp_path / "run" / "completions.jsonl").read_text().splitlines()[0])
    assert row["prompt"] == "go" and row["completion"].count("echo ") == 1  # the one step not done
