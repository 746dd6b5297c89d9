"""`grpoflow eval` on the tiny model and run checkpoints, on the CPU."""

from __future__ import annotations

import json

import pytest
from helpers.support import recipe

from grpoflow import cli
from grpoflow.run.build import run
from grpoflow.run.evaluate_model import COMPLETIONS_FILE, RESULTS_FILE


def test_eval_on_packaged_gsm8k_rows_prints_the_table_and_writes_every_completion(tmp_path, capsys):
    pytest.importorskip("math_verify")
    output = tmp_path / "eval"
    flags = ["--model", "tiny", "--eval_dataset", "gsm8k#3", "--reward_funcs", "accuracy", "format"]
    flags += ["--num_generations_eval", "4", "--max_completion_length", "8", "--max_prompt_length", "512"]
    assert cli.main(["eval", *flags, "--output_dir", str(output), "--reward_num_workers", "0"]) == 0
    table = capsys.readouterr().out
    for name in (
        "pass@1",
        "pass@2",
        "pass@4",
        "maj@4",
        "avg@4",
        "rewards/accuracy/mean",
        "tokens_per_second",
    ):
        assert name in table, name
    results = json.loads((output / RESULTS_FILE).read_text())
    assert results["settings"]["dataset"] == ["gsm8k#3"] and results["settings"]["split"] == "test"
    assert results["metrics"]["eval/num_prompts"] == 3
    rows = [json.loads(line) for line in (output / COMPLETIONS_FILE).read_text().splitlines()]
    assert len(rows) == 12
    assert set(rows[0]["rewards"]) == {"accuracy", "format"}


@pytest.mark.slow
@pytest.mark.parametrize("train_type", ["full", "lora"])
def test_eval_takes_a_runs_checkpoint(tmp_path, capsys, train_type):
    if train_type == "lora":
        pytest.importorskip("peft")
    run(recipe(tmp_path, max_steps=2, save_steps=2, train_type=train_type, learning_rate=0.05))
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "adapter_config.json").is_file() == (train_type == "lora")
    output = tmp_path / "eval"
    flags = ["--model", str(checkpoint), "--eval_dataset", "echo#8", "--reward_funcs", "echo"]
    flags += ["--num_generations_eval", "2", "--max_completion_length", "8", "--max_prompt_length", "16"]
    assert cli.main(["eval", *flags, "--output_dir", str(output)]) == 0
    metrics = json.loads((output / RESULTS_FILE).read_text())["metrics"]
    assert metrics["eval/num_prompts"] == 8


def test_eval_errors_are_usage_errors(tmp_path, capsys):
    assert (
        cli.main(["eval", "--model", "tiny", "--eval_dataset", "echo#2", "--output_dir", str(tmp_path)]) == 2
    )
    assert "reward_funcs" in capsys.readouterr().err
