"""What a new user meets first: one-line messages in the user's words, with the fix; no HTTP
request lines in a run's log; a run that stopped before any progress restarts in place."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from grpoflow import cli, hub
from grpoflow.run.build import quiet_request_logs
from grpoflow.run.output_dir import RUN_FILE, claim_output_dir

RECIPE_DIR = Path(__file__).parent.parent / "recipes"


def test_a_missing_agent_extra_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)
    output = tmp_path / "run"
    assert (
        cli.main(["train", "--config", "relay-agent", "--max_steps", "1", "--output_dir", str(output)]) == 2
    )
    message = capsys.readouterr().err.strip()
    assert (
        message.count("\n") == 0 and "needs openai, not installed: pip install 'grpoflow[agent]'" in message
    )
    assert not output.exists()


def test_plan_without_the_hub_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(hub, "unreachable", lambda: True)
    recipe = str(RECIPE_DIR / "qwen2.5-0.5b-gsm8k.yaml")
    assert cli.main(["plan", "--config", recipe, "--gpu_memory_gib", "80"]) == 2
    message = capsys.readouterr().err.strip()
    assert message.count("\n") == 0 and "cannot be reached" in message


def test_a_misspelled_key_in_a_recipe_suggests_the_real_flag(tmp_path, capsys):
    recipe = tmp_path / "my.yaml"
    recipe.write_text("model: tiny\ndataset: relay\nmax_turn: 4\n")
    assert cli.main(["train", "--config", str(recipe), "--output_dir", str(tmp_path / "run")]) == 2
    message = capsys.readouterr().err.strip()
    assert "did you mean max_turns" in message and "--max_turn " not in message + " "
    assert f"max_turn=4 set by {recipe}; the option is spelled max_turns (--max_turns)" in message


def test_a_misspelled_reward_gets_a_suggestion_in_the_users_words(tmp_path, capsys):
    assert cli.main(["train", "--reward_funcs", "ecco", "--output_dir", str(tmp_path / "run")]) == 2
    message = capsys.readouterr().err.strip()
    assert "Unknown reward 'ecco'; did you mean echo?" in message
    assert "load_plugins" not in message and "external_plugins" in message


def test_http_request_lines_are_kept_out_of_a_run(caplog):
    caplog.set_level(logging.INFO)
    quiet_request_logs()
    logging.getLogger("httpx").info('HTTP Request: POST http://127.0.0.1/v1/chat/completions "200 OK"')
    logging.getLogger("httpx").warning("kept")
    assert [record.getMessage() for record in caplog.records] == ["kept"]


def test_a_run_stopped_before_any_progress_starts_over_and_latest_says_how(tmp_path, caplog):
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / RUN_FILE).write_text(json.dumps({"run_id": "old"}))
    (directory / "metrics.jsonl").write_text("")
    caplog.set_level(logging.INFO)
    claim = claim_output_dir(directory, None, overwrite=False)
    assert claim.run_id != "old" and "starting over there" in caplog.text
    with pytest.raises(ValueError, match="nothing to resume; start the run afresh without --resume_from"):
        claim_output_dir(directory, "latest", overwrite=False)
    (directory / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match="It has no checkpoint to resume: start over with --overwrite"):
        claim_output_dir(directory, None, overwrite=False)


def test_an_interrupted_run_without_a_checkpoint_says_how_to_start_over(tmp_path):
    assert cli.interrupted(0, str(tmp_path)).endswith("run the same command to start over there")
    assert "run again with --overwrite_output_dir true" in cli.interrupted(3, str(tmp_path))
