import pytest

from grpoflow import cli
from grpoflow.run.config import load_config


def test_no_command_prints_usage(capsys):
    assert cli.main([]) == 2
    assert "usage: grpoflow {train}" in capsys.readouterr().err


def test_unknown_command_prints_usage(capsys):
    assert cli.main(["frobnicate"]) == 2
    usage = capsys.readouterr().err
    assert "usage: grpoflow {train}" in usage
    assert "grpoflow {export}" in usage and "grpoflow {serve}" in usage


def test_serve_without_a_model_prints_usage(capsys):
    assert cli.main(["serve"]) == 2
    assert "grpoflow {serve} --model MODEL" in capsys.readouterr().err


def test_unknown_key_is_a_usage_error(capsys):
    assert cli.main(["train", "--nonexistent_key", "1"]) == 2
    captured = capsys.readouterr()
    assert "grpoflow train: unknown config key 'nonexistent_key'" in captured.err
    assert captured.out == ""


def test_bad_value_is_a_usage_error(capsys):
    assert cli.main(["train", "--loss_type", "foo"]) == 2
    assert "loss_type must be one of grpo, bnpo, dr_grpo, dapo" in capsys.readouterr().err


def test_unknown_recipe_is_a_usage_error(capsys):
    assert cli.main(["train", "--config", "no-such-recipe"]) == 2
    assert "--config no-such-recipe: no such file" in capsys.readouterr().err


def test_positional_word_is_a_usage_error(capsys):
    assert cli.main(["train", "stray"]) == 2
    assert "unexpected argument 'stray'" in capsys.readouterr().err


def test_help_lists_every_key(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for key in ("--learning_rate", "--num_generations", "--reward_funcs", "--max_completion_length"):
        assert key in out
    assert "[generation]" in out and "[rewards]" in out


def test_resolve_recipe_default():
    assert cli.resolve_recipe(None, {}) == cli.DEFAULT_RECIPE
    assert cli.DEFAULT_RECIPE.is_file()
    # with a model named on the command line, no recipe is assumed
    assert cli.resolve_recipe(None, {"model": "some/model"}) is None


def test_resolve_recipe_path(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model: tiny\n")
    assert cli.resolve_recipe(str(recipe), {}) == recipe


@pytest.mark.parametrize("name", ["default", "default.yaml"])
def test_resolve_recipe_packaged_name(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file of that name in the working directory
    assert cli.resolve_recipe(name, {}) == cli.RECIPES / "default.yaml"


def test_resolve_recipe_unknown_name():
    with pytest.raises(ValueError, match=r"--config nope: no such file.*\(.*default.*\)"):
        cli.resolve_recipe("nope", {})


def test_every_packaged_recipe_loads():
    recipes = sorted(cli.RECIPES.glob("*.yaml"))
    assert cli.DEFAULT_RECIPE in recipes
    for recipe in recipes:
        load_config(recipe)
