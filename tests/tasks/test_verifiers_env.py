"""verifiers environments by name: their tasks as prompts, their weighted rewards as the episode's
reward, a multi-turn environment's messages between the policy's turns, and runs of the tiny model
through the CLI's entry on a single-turn and a multi-turn environment defined in tests/helpers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from grpoflow.agents.config import AgentConfig
from grpoflow.cli import RECIPES
from grpoflow.data.prompts import load_rows
from grpoflow.run.build import run
from grpoflow.run.config import load_config
from grpoflow.tasks import library_environment

pytest.importorskip("verifiers.v1")

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


@pytest.fixture(autouse=True)
def tasksets_on_path(monkeypatch):
    """The test tasksets import by id, as an installed taskset package would."""
    monkeypatch.syspath_prepend(str(HELPERS))


def play(environment, task: int, replies: list[str]) -> tuple[list, float]:
    """An episode played with fixed replies: what the environment said, and the reward."""

    async def episode():
        said = [await environment.reset(verifiers_task=task, prompt="")]
        for reply in replies:
            said.append(await environment.respond(reply))
        return said

    said = asyncio.run(episode())
    return said, environment.get_reward()


def test_tasks_are_rows_and_the_rewards_are_weighted():
    rows = load_rows("verifiers:vf-letters?num_tasks=4")
    assert rows == [
        {"prompt": f"echo {letter}:", "verifiers_task": index} for index, letter in enumerate("abcd")
    ]
    environment = library_environment("verifiers:vf-letters?num_tasks=4")()
    said, reward = play(environment, 2, ["ccccxxxx"])
    assert said == [None, None]  # one turn: no message before it, none after
    assert reward == pytest.approx(0.5 * 1.0 + 1.0 * 0.5)  # echoed 4/8 (weight 1), short (weight 0.5)


def test_a_multi_turn_environment_speaks_between_turns():
    environment = library_environment("verifiers:vf-relay")()
    said, reward = play(environment, 0, ["aaaa", "cc", "eeee"])
    assert said == [None, "echo c:", "echo e:", None]
    assert reward == pytest.approx((1 + 0.5 + 1) / 3)


def test_an_episode_a_limit_ends_is_scored_and_its_run_wound_down():
    environment = library_environment("verifiers:vf-relay")()
    said, reward = play(environment, 0, ["aaaa"])
    assert said == [None, "echo c:"]
    assert reward == pytest.approx(1 / 3)
    assert environment.driver.result(timeout=5) is None  # Env.run saw a terminated turn and returned


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("verifiers:vf-nowhere", "verifiers could not load it: taskset 'vf-nowhere' not found"),
        ("verifiers:vf-letters?colour=red", "verifiers could not load it: .*colour"),
        ("verifiers:vf-pair", "has the agent seats first, second; grpoflow trains an environment with one"),
        ("gym:thing", "names no library's environment: write verifiers:NAME"),
    ],
)
def test_bad_environment_specs_are_explained(spec, message):
    with pytest.raises(ValueError, match=message):
        library_environment(spec)


def test_environment_and_environment_factory_are_exclusive():
    with pytest.raises(ValueError, match="environment must be unset with environment_factory"):
        AgentConfig(environment="verifiers:vf-letters", environment_factory="pkg:Env")


def config(tmp_path, **overrides):
    values = {
        "dataset": [],
        "reward_funcs": [],
        "num_generations": 4,
        "per_device_train_batch_size": 16,
        "max_prompt_length": 16,
        "max_steps": 2,
        "output_dir": str(tmp_path / "run"),
        "report_to": ["none"],
        "disable_tqdm": True,
        "html_report": False,
        "log_completions": True,
        "save_steps": 100,
    }
    return load_config(RECIPES / "default.yaml", {**values, **overrides})


def test_a_run_trains_on_a_verifiers_environment_by_name(tmp_path):
    history = run(config(tmp_path, environment="verifiers:vf-letters", max_completion_length=8))
    assert len(history) == 2
    assert all(0.0 <= step["rewards/VerifiersEnvironment/mean"] <= 1.5 for step in history)
    row = json.loads((tmp_path / "run" / "completions.jsonl").read_text().splitlines()[0])
    assert row["prompt"].startswith("echo ") and set(row["rewards"]) == {"VerifiersEnvironment"}


def test_a_run_plays_a_multi_turn_verifiers_environment(tmp_path):
    overrides = {"environment": "verifiers:vf-relay", "max_turn_tokens": 4, "max_completion_length": 40}
    history = run(config(tmp_path, **overrides))
    step = history[-1]
    assert step["episodes/turns_mean"] == 3.0 and step["episodes/ended_by/stop"] == 1.0
    assert 0.0 <= step["rewards/VerifiersEnvironment/mean"] <= 1.0
    row = json.loads((tmp_path / "run" / "completions.jsonl").read_text().splitlines()[0])
    assert "echo c:" in row["completion"] and "echo e:" in row["completion"]
