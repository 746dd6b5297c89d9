import sys

import pytest

from grpoflow import cli
from grpoflow.run.checkpoint import MARKER, STATE_FILE
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
    assert (
        "loss_type must be one of grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo"
        in capsys.readouterr().err
    )


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


def test_help_and_version_exit_zero_and_a_misspelled_command_is_named(capsys):
    assert cli.main(["--help"]) == 0
    assert "grpoflow {train}" in capsys.readouterr().out
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("grpoflow ")
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'; did you mean train?" in capsys.readouterr().err


def test_train_help_gives_each_option_its_documentation_allowed_values_and_the_embedded_recipe(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert (
        "--loss_type (default: 'dapo'; one of grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo)  Per-token surrogate and reduction (`algo.LOSS_TYPES`)."
        in out
    )
    assert "the embedded recipe applies" in out and "max_prompt_length=16" in out


def test_a_malformed_recipe_and_a_flag_without_its_value_are_one_line_each(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model: tiny\n  bad: [1\n")
    assert cli.main(["train", "--config", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"grpoflow train: config file {recipe} is not valid YAML at line 2, column 6: mapping values are not allowed here"
    )
    assert cli.main(["train", "--learning_rate"]) == 2
    assert "learning_rate needs a value: --learning_rate VALUE" in capsys.readouterr().err


def test_an_interrupted_run_says_where_it_stopped_and_how_to_resume(tmp_path):
    assert "before its first checkpoint" in cli.interrupted(3, str(tmp_path))
    (tmp_path / "checkpoint-2").mkdir()
    for name in (STATE_FILE, MARKER):
        (tmp_path / "checkpoint-2" / name).write_text("")
    message = cli.interrupted(3, str(tmp_path))
    assert "stopped at step 3; resume from" in message and "--resume_from_checkpoint latest" in message


def test_the_last_line_counts_reward_errors(tmp_path, capsys):
    plugin = tmp_path / "plugin.py"
    plugin.write_text("def broken(completions, **kwargs):\n    raise RuntimeError('down')\n")
    argv = [
        "train",
        "--max_steps",
        "1",
        "--per_device_train_batch_size",
        "16",
        "--output_dir",
        str(tmp_path / "run"),
        "--report_to",
        "none",
        "--html_report",
        "false",
    ]
    assert cli.main([*argv, "--reward_funcs", "echo", f"{plugin}:broken", "--disable_tqdm", "true"]) == 0
    assert "reward errors (logged as warnings)" in capsys.readouterr().out


def test_a_reward_whose_dependency_is_missing_stops_the_run_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    output = tmp_path / "run"
    argv = ["train", "--model", "tiny", "--dataset", "gsm8k", "--reward_funcs", "accuracy", "format"]
    assert cli.main([*argv, "--max_steps", "2", "--output_dir", str(output)]) == 2
    message = capsys.readouterr().err.strip()
    assert message.count("\n") == 0 and "pip install 'grpoflow[math]'" in message
    assert not output.exists()


def test_a_reward_failing_on_every_sample_stops_the_run_with_a_checkpoint(tmp_path, capsys):
    plugin = tmp_path / "plugin.py"
    plugin.write_text("def broken(completions, **kwargs):\n    raise RuntimeError('service down')\n")
    output = tmp_path / "run"
    argv = [
        "train",
        "--max_steps",
        "10",
        "--per_device_train_batch_size",
        "16",
        "--output_dir",
        str(output),
        "--report_to",
        "none",
        "--html_report",
        "false",
    ]
    argv += ["--reward_funcs", "echo", f"{plugin}:broken", "--disable_tqdm", "true"]
    assert cli.main([*argv, "--max_consecutive_reward_failures", "3"]) == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "stopped at step 3: reward 'broken' failed on every sample for 3 steps in a row" in message
    assert "RuntimeError: service down" in message and "--resume_from_checkpoint latest" in message
    assert (output / "checkpoint-3").is_dir()


def test_an_error_about_a_recipe_setting_says_where_it_came_from(tmp_path, capsys):
    argv = ["train", "--dataset", "gsm8k", "--max_steps", "1", "--output_dir", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "prompt of 155 tokens > max_prompt_length=16" in message
    assert "max_prompt_length=16 set by the embedded default recipe" in message
    assert "--max_prompt_length overrides it" in message


OPTIONAL = (
    "httpx",
    "openai",
    "fastapi",
    "uvicorn",
    "starlette",
    "matplotlib",
    "vllm",
    "peft",
    "datasets",
    "math_verify",
    "atroposlib",
    "tensorboard",
    "trl",
)
"""Packages of the extras: the core (`pip install grpoflow`) has none of them."""


@pytest.mark.slow
def test_the_embedded_default_trains_on_the_core_dependencies_alone(tmp_path):
    """`pip install grpoflow` without extras: `grpoflow train` runs, and the report is skipped with
    a line saying how to get it."""
    import subprocess

    blocker = (  # a module set to None in sys.modules is one Python cannot import or find
        "import sys\n"
        f"sys.modules.update(dict.fromkeys({OPTIONAL!r}))\n"
        "from grpoflow.cli import main\n"
        "sys.exit(main())\n"
    )
    flags = ["train", "--max_steps", "1", "--per_device_train_batch_size", "16", "--disable_tqdm", "true"]
    flags += ["--output_dir", str(tmp_path / "run")]
    done = subprocess.run(
        [sys.executable, "-c", blocker, *flags], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pip install 'grpoflow[report]'" in done.stderr + done.stdout
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
