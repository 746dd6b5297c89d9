import textwrap

import pytest

from grpoflow.rewards import REWARD_REGISTRY, RewardConfig, get_reward, load_plugins, orms, resolve_reward
from grpoflow.rewards.plugins import plugin_files

TRL_STYLE = """
def reward_len(completions, **kwargs):
    return [-abs(20 - len(c)) for c in completions]

NOT_CALLABLE = 3
"""


def write(path, source):
    path.write_text(textwrap.dedent(source))
    return path


def test_plugin_registers_with_decorator_and_orms(tmp_path):
    plugin = write(
        tmp_path / "my_plugin.py",
        """
        from grpoflow.rewards import ORM, orms, register_reward

        @register_reward("plugin_len")
        def plugin_len(completions, **kwargs):
            return [float(len(c)) for c in completions]

        class LongEnough(ORM):
            def __call__(self, completions, **kwargs):
                return [1.0 if len(c) > 4 else 0.0 for c in completions]

        class Budget:
            def __init__(self, config):
                self.limit = config.max_completion_length

            def __call__(self, completions, completion_ids, **kwargs):
                return [1.0 if len(ids) <= self.limit else 0.0 for ids in completion_ids]

        orms["long_enough"] = LongEnough
        orms["budget"] = Budget
        """,
    )
    (module,) = load_plugins([str(plugin)])
    assert get_reward("plugin_len")(completions=["ab", "abc"]) == [2.0, 3.0]
    assert get_reward("long_enough")(completions=["abcde", "a"]) == [1.0, 0.0]
    budget = get_reward("budget", RewardConfig(max_completion_length=2))
    assert budget(completions=["a", "b"], completion_ids=[[1, 2], [1, 2, 3]]) == [1.0, 0.0]
    assert orms["long_enough"] is module.LongEnough
    assert plugin_files([module.plugin_len]) == [str(plugin.resolve())]
    assert load_plugins([plugin]) == [module]  # executed once


def test_plugin_with_predefined_and_local_orms(tmp_path):
    predefined = write(
        tmp_path / "uses_predefined.py",
        """
        class One:
            def __call__(self, completions, **kwargs):
                return [1.0] * len(completions)

        orms["one"] = One  # `orms` is predefined in plugin files
        """,
    )
    local = write(
        tmp_path / "local_table.py",
        """
        def two(completions, **kwargs):
            return [2.0] * len(completions)

        orms = {"two": two}
        """,
    )
    load_plugins([predefined, local])
    assert get_reward("one")(completions=["x"]) == [1.0]
    assert get_reward("two")(completions=["x"]) == [2.0]
    assert "two" in orms


def test_plugin_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_plugins([tmp_path / "missing.py"])
    broken = write(tmp_path / "broken.py", "raise RuntimeError('boom in plugin')\n")
    with pytest.raises(ValueError, match="failed to import: RuntimeError: boom in plugin"):
        load_plugins([broken])
    swift = write(tmp_path / "swift_style.py", "from swift.plugin import ORM, orms\n")
    with pytest.raises(ValueError, match="from grpoflow.rewards import ORM, orms"):
        load_plugins([swift])


@pytest.fixture
def trl_module(tmp_path, monkeypatch):
    package = tmp_path / "trl_rewards_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write(package / "lengths.py", TRL_STYLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return package / "lengths.py"


@pytest.mark.parametrize(
    "spec", ["trl_rewards_pkg.lengths:reward_len", "trl_rewards_pkg.lengths.reward_len", "FILE:reward_len"]
)
def test_trl_function_by_import_path(trl_module, spec):
    reward = resolve_reward(spec.replace("FILE", str(trl_module)))
    assert reward.__name__ == "reward_len"
    assert reward(completions=["x" * 20, "x" * 25]) == [0, -5]


def test_a_reward_file_imports_the_modules_beside_it(tmp_path):
    folder = tmp_path / "my_rewards"
    folder.mkdir()
    write(folder / "scoring_helpers_beside.py", "def target():\n    return 3\n")
    rewards = write(
        folder / "rewards.py",
        """
        from scoring_helpers_beside import target

        def near(completions, **kwargs):
            return [-abs(target() - len(c)) for c in completions]
        """,
    )
    assert resolve_reward(f"{rewards}:near")(completions=["abc", "a"]) == [0, -2]


def test_resolve_registered_name_callable_and_class():
    assert resolve_reward("format")(completions=["<think></think><answer>1</answer>"]) == [1.0]

    def custom(completions, **kwargs):
        return [0.0] * len(completions)

    assert resolve_reward(custom) is custom

    class WithConfig:
        def __init__(self, config):
            self.config = config

        def __call__(self, completions, **kwargs):
            return [self.config.repetition_max_penalty] * len(completions)

    assert resolve_reward(WithConfig, RewardConfig(repetition_max_penalty=-3.0))(completions=["a"]) == [-3.0]


def test_resolve_errors(trl_module, tmp_path):
    with pytest.raises(ValueError, match="Unknown reward 'nothing'.*accuracy"):
        resolve_reward("nothing")
    with pytest.raises(ValueError, match="importing module 'no_such_pkg.mod' failed: ModuleNotFoundError"):
        resolve_reward("no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'.*reward_len"):
        resolve_reward("trl_rewards_pkg.lengths:missing")
    with pytest.raises(ValueError, match="not callable"):
        resolve_reward("trl_rewards_pkg.lengths:NOT_CALLABLE")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_reward(str(tmp_path / "nope.py") + ":fn")
    with pytest.raises(ValueError, match="name the object in the file.*:name"):
        resolve_reward(str(trl_module))
    assert "reward_len" not in REWARD_REGISTRY
