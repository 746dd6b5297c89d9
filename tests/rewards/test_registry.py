import logging

import pytest

from grpoflow.rewards import ORM, REWARD_REGISTRY, RewardConfig, get_reward, orms, register_reward


def test_builtins_are_registered():
    assert {"accuracy", "format", "cosine", "repetition", "soft_overlong"} <= set(REWARD_REGISTRY)


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match=r"Unknown reward 'nope'.*accuracy.*format"):
        get_reward("nope")


def test_plain_reward_function_is_registered_as_is():
    @register_reward("short")
    def short(completions, **kwargs):
        return [1.0 if len(c) < 5 else 0.0 for c in completions]

    assert get_reward("short") is short
    assert short(["abc", "abcdefgh"]) == [1.0, 0.0]


def test_factory_receives_the_config():
    @register_reward("scaled")
    def make_scaled(config):
        def scaled(completions, **kwargs):
            return [config.repetition_max_penalty] * len(completions)

        return scaled

    reward = get_reward("scaled", RewardConfig(repetition_max_penalty=-2.0))
    assert reward(["a", "b"]) == [-2.0, -2.0]


def test_class_with_config_argument_gets_it():
    @register_reward("with_config")
    class WithConfig:
        def __init__(self, config):
            self.config = config

        def __call__(self, completions, **kwargs):
            return [float(self.config.max_completion_length)] * len(completions)

    assert get_reward("with_config", RewardConfig(max_completion_length=7))(["x"]) == [7.0]


def test_orms_assignment_registers_no_argument_class():
    class Dummy(ORM):
        def __call__(self, completions, **kwargs):
            return [1.0 if len(c) > 3 else 0.0 for c in completions]

    orms["dummy"] = Dummy
    assert "dummy" in REWARD_REGISTRY
    assert orms["dummy"] is Dummy
    assert get_reward("dummy")(["abcd", "a"]) == [1.0, 0.0]
    del orms["dummy"]
    assert "dummy" not in REWARD_REGISTRY


def test_orm_base_requires_call():
    with pytest.raises(NotImplementedError, match="__call__"):
        ORM()(["x"])


def test_registering_a_taken_name_warns(caplog):
    @register_reward("twice")
    def first(completions, **kwargs):
        return [0.0] * len(completions)

    with caplog.at_level(logging.WARNING, logger="grpoflow.rewards"):

        @register_reward("twice")
        def second(completions, **kwargs):
            return [1.0] * len(completions)

    assert "registered again" in caplog.text
    assert get_reward("twice") is second


def test_register_rejects_non_callables_and_bad_names():
    with pytest.raises(ValueError, match="non-empty string"):
        register_reward("")
    with pytest.raises(ValueError, match="class or a callable"):
        register_reward("number")(3)
