"""The agent section in a training run: the packaged relay recipe, the environment's reward, bad
environment specs."""

from __future__ import annotations

import json

import pytest

from grpoflow.agents.setup import environment_rewards, load_environment_factory
from grpoflow.cli import RECIPES
from grpoflow.policy.tiny import build_char_tokenizer
from grpoflow.run.build import run
from grpoflow.run.config import load_config
from grpoflow.tasks.relay import RelayEnvironment


def relay(tmp_path, **overrides):
    values = {
        "output_dir": str(tmp_path / "run"),
        "report_to": ["none"],
        "disable_tqdm": True,
        "html_report": False,
    }
    return load_config(RECIPES / "relay.yaml", {**values, "per_device_train_batch_size": 32, **overrides})


def test_a_relay_run_trains_on_episodes_and_logs_them(tmp_path):
    history = run(relay(tmp_path, max_steps=2, log_completions=True))
    step = history[-1]
    assert step["episodes/turns_mean"] == 3.0 and step["episodes/ended_by/stop"] == 1.0
    assert 0.4 < step["episodes/masked_token_fraction"] < 0.8
    assert "rewards/RelayEnvironment/mean" in step and step["time/environment"] >= 0
    row = json.loads((tmp_path / "run" / "completions.jsonl").read_text().splitlines()[0])
    assert row["completion"].count("echo") == 2  # the environment's two instructions, inside the completion
    assert set(row["rewards"]) == {"RelayEnvironment"}


def test_the_environment_reward_is_named_after_its_class_and_reads_each_episode():
    ((name, reward),) = environment_rewards(RelayEnvironment)
    environment = RelayEnvironment()
    environment.reset(letters="ab")
    environment.respond("aaaa")
    assert name == "RelayEnvironment"
    assert reward(completions=["x", "y"], environments=[environment, None]) == [0.5, None]
    assert environment_rewards(None) == []


def test_bad_environment_specs_are_explained(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text("class NoReset:\n    pass\n\nVALUE = 3\n")
    with pytest.raises(ValueError, match="NoReset has no reset method"):
        load_environment_factory(f"{path}:NoReset")
    with pytest.raises(ValueError, match="is a int, not a class or function"):
        load_environment_factory(f"{path}:VALUE")
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        load_environment_factory(f"{path}:Missing")


def plain_tokenizer():
    """The character tokenizer without its chat template (a base model's)."""
    from grpoflow.policy.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


def build_runner(config, tokenizer, factory=None):
    from grpoflow.agents.setup import build_episode_runner

    return build_episode_runner(
        config,
        tokenizer,
        factory,
        max_completion_length=8,
        max_prompt_length=8,
        system=None,
        per_prompt_params=False,
    )


def test_tools_without_a_chat_template_are_refused(tmp_path):
    from grpoflow.agents.config import AgentConfig

    path = tmp_path / "calc.py"
    path.write_text(
        'def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: A.\n        b: B.\n    """\n    return a + b\n'
    )
    config = AgentConfig(tools=[f"{path}:add"])
    with pytest.raises(ValueError, match="this run has tools add; tools are shown to the model by its chat"):
        build_runner(config, plain_tokenizer())
    assert build_runner(config, build_char_tokenizer()) is not None  # the tiny model's template shows them


class Counter:
    """Answers in words, and has a public method (a tool, by TRL's rule)."""

    def reset(self, **row):
        self.count = 0

    def respond(self, text):
        return None

    def bump(self, by: int) -> int:
        """Count.

        Args:
            by: How much.
        """
        self.count += by
        return self.count


def test_an_environment_that_responds_is_told_its_public_methods_are_tools():
    from grpoflow.agents.config import AgentConfig

    with pytest.raises(ValueError) as refused:
        build_runner(AgentConfig(environment_factory="unused"), plain_tokenizer(), Counter)
    message = str(refused.value)
    assert "Counter's public methods bump" in message and "prefix a helper's name with _" in message
    assert "respond(text)" not in message


def test_an_unknown_tool_call_parser_is_named_with_the_known_ones():
    from grpoflow.agents.config import AgentConfig

    with pytest.raises(ValueError, match="tool_call_parser must be one of .*hermes"):
        AgentConfig(tool_call_parser="mistral_v9")


def test_a_mapping_of_environments_gives_one_reward_per_class_each_scoring_only_its_own():
    from helpers.environments import Shout

    rewards = dict(environment_rewards({"relay": RelayEnvironment, "shout": Shout, "again": Shout}))
    assert list(rewards) == ["RelayEnvironment", "Shout"]
    relay, shout = RelayEnvironment(), Shout()
    relay.reset(letters="ab")
    relay.respond("aaaa")
    shout.reset()
    shout.respond("hi")
    assert rewards["RelayEnvironment"](completions=[1, 2, 3], environments=[relay, shout, None]) == [
        0.5,
        None,
        None,
    ]
    assert rewards["Shout"](completions=[1, 2, 3], environments=[relay, shout, None]) == [None, 1.0, None]


def test_environment_factory_mapping_from_yaml_and_from_the_flag(tmp_path):
    from grpoflow.options import parse_overrides

    path = tmp_path / "envs.py"
    path.write_text("class Other:\n    def reset(self, **row):\n        pass\n")
    expected = {"relay": "grpoflow.tasks.relay:RelayEnvironment", "other": f"{path}:Other"}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model: tiny\ndataset: relay\nenvironment_factory:\n  relay: grpoflow.tasks.relay:RelayEnvironment\n  other: {path}:Other\n"
    )
    from_yaml = load_config(recipe).agent.environment_factory
    flag = parse_overrides(
        ["--environment_factory", f"relay=grpoflow.tasks.relay:RelayEnvironment,other={path}:Other"]
    )
    from_flag = load_config(RECIPES / "relay.yaml", flag).agent.environment_factory
    assert from_yaml == from_flag == expected
    assert (
        load_config(RECIPES / "relay.yaml").agent.environment_factory
        == "grpoflow.tasks.relay:RelayEnvironment"
    )
    factories = load_environment_factory(from_flag)
    assert factories["relay"] is RelayEnvironment and factories["other"].__name__ == "Other"
    with pytest.raises(
        ValueError, match="environment_factory must be an import path, or a non-empty mapping"
    ):
        load_config(None, {"model": "tiny", "dataset": "relay", "environment_factory": {"": "x:Y"}})


def test_a_rollout_func_beside_tools_or_environments_is_refused():
    with pytest.raises(
        ValueError, match="rollout_func must be unset when tools or environment_factory are set"
    ):
        load_config(RECIPES / "relay.yaml", {"rollout_func": "x.py:f"})
