"""One run per output directory: refusal, overwrite, resume of the directory's own run, logs cut
back on resume. Runs the embedded tiny recipe on the CPU."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from helpers.support import read_jsonl, recipe

from grpoflow import cli
from grpoflow.run.build import run
from grpoflow.run.checkpoint import checkpoint_run_id, list_checkpoints
from grpoflow.run.output_dir import RUN_FILE, claim_output_dir, cut_log, run_id_of


def steps_logged(directory):
    return [row["step"] for row in read_jsonl(directory / "metrics.jsonl")]


def names(directory):
    return [path.name for path in list_checkpoints(directory)]


def test_a_new_run_refuses_a_directory_holding_another_run(tmp_path, capsys):
    run(recipe(tmp_path, max_steps=2, save_steps=1))
    capsys.readouterr()
    argv = ["train", "--max_steps", "2", "--output_dir", str(tmp_path / "run"), "--disable_tqdm", "true"]
    assert cli.main(argv) == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message
    assert "holds another run (2 checkpoints up to checkpoint-2" in message
    assert "--resume_from_checkpoint latest" in message and "--overwrite_output_dir true" in message
    assert steps_logged(tmp_path / "run") == [1, 2]


def test_overwrite_output_dir_replaces_the_old_run_and_keeps_other_files(tmp_path):
    run(recipe(tmp_path, max_steps=3, save_steps=1, log_completions=True))
    (tmp_path / "run" / "notes.txt").write_text("mine")
    old_id = run_id_of(tmp_path / "run")
    run(recipe(tmp_path, max_steps=2, save_steps=2, save_total_limit=1, overwrite_output_dir=True))
    directory = tmp_path / "run"
    assert names(directory) == ["checkpoint-2"]  # the old run's checkpoint-3 did not outlive it
    assert steps_logged(directory) == [1, 2]
    assert not (directory / "completions.jsonl").exists()
    assert (directory / "notes.txt").read_text() == "mine"
    assert run_id_of(directory) not in (None, old_id)
    assert checkpoint_run_id(directory / "checkpoint-2") == run_id_of(directory)


def test_overwrite_removes_symlinked_run_files_without_following_them(tmp_path):
    """A symlinked `runs/` or checkpoint once stopped the overwrite with a raw OSError: the link
    goes, what it points to stays."""
    directory, outside = tmp_path / "run", tmp_path / "elsewhere"
    directory.mkdir()
    (outside / "tb").mkdir(parents=True)
    (outside / "tb" / "events").write_text("keep")
    (directory / RUN_FILE).write_text(json.dumps({"run_id": "old"}))
    (directory / "runs").symlink_to(outside / "tb", target_is_directory=True)
    (directory / "checkpoint-3").symlink_to(outside, target_is_directory=True)
    claim_output_dir(directory, None, overwrite=True).apply()
    assert not (directory / "runs").exists() and not (directory / "runs").is_symlink()
    assert (outside / "tb" / "events").read_text() == "keep"


def test_resume_cuts_the_logs_back_so_no_step_is_logged_twice(tmp_path):
    run(recipe(tmp_path, max_steps=4, save_steps=2, log_completions=True))
    directory = tmp_path / "run"
    shutil.rmtree(directory / "checkpoint-4")  # the run died after logging steps 3 and 4
    completions_before = [row["step"] for row in read_jsonl(directory / "completions.jsonl")]
    run(recipe(tmp_path, max_steps=4, save_steps=2, log_completions=True, resume_from_checkpoint="latest"))
    assert steps_logged(directory) == [1, 2, 3, 4]
    assert [row["step"] for row in read_jsonl(directory / "completions.jsonl")] == completions_before
    assert names(directory) == ["checkpoint-2", "checkpoint-4"]


def test_latest_resumes_only_the_directorys_own_run(tmp_path):
    run(recipe(tmp_path, max_steps=2, save_steps=1))
    directory = tmp_path / "run"
    foreign = directory / "checkpoint-60"
    shutil.copytree(directory / "checkpoint-2", foreign)
    (foreign / "COMPLETE").write_text(json.dumps({"step": 60, "run_id": "another-run"}))
    claim = claim_output_dir(directory, "latest", overwrite=False)
    assert claim.resume == directory / "checkpoint-2" and claim.run_id == run_id_of(directory)


def test_resuming_an_older_checkpoint_needs_overwrite_to_drop_the_later_ones(tmp_path):
    run(recipe(tmp_path, max_steps=3, save_steps=1, save_total_limit=None))
    directory = tmp_path / "run"
    with pytest.raises(ValueError, match="older than .*checkpoint-3 of the same run"):
        claim_output_dir(directory, str(directory / "checkpoint-1"), overwrite=False)
    claim = claim_output_dir(directory, str(directory / "checkpoint-1"), overwrite=True)
    claim.apply()
    assert names(directory) == ["checkpoint-1"] and steps_logged(directory) == [1]


def test_resuming_into_a_directory_of_another_run_is_refused(tmp_path):
    run(recipe(tmp_path / "a", max_steps=1))
    run(recipe(tmp_path / "b", max_steps=1))
    checkpoint = tmp_path / "a" / "run" / "checkpoint-1"
    with pytest.raises(ValueError, match="holds another run than the one of"):
        claim_output_dir(tmp_path / "b" / "run", str(checkpoint), overwrite=False)
    assert claim_output_dir(tmp_path / "c", str(checkpoint), overwrite=False).run_id == checkpoint_run_id(
        checkpoint
    )


def test_nothing_is_written_when_the_run_fails_while_it_is_built(tmp_path):
    with pytest.raises(ValueError, match="Unknown reward"):
        run(recipe(tmp_path, max_steps=1, reward_funcs=["no_such_reward"]))
    assert not (tmp_path / "run" / RUN_FILE).exists()


def test_resuming_with_changed_settings_warns(tmp_path, caplog):
    run(recipe(tmp_path, max_steps=2, save_steps=2))
    with caplog.at_level(logging.WARNING):
        run(recipe(tmp_path, max_steps=3, save_steps=2, num_generations=4, resume_from_checkpoint="latest"))
    message = "\n".join(record.getMessage() for record in caplog.records)
    assert "differ from the checkpoint's" in message and "num_generations 8 -> 4" in message
    assert "save_steps" not in message


def test_cut_log_keeps_rows_up_to_a_step_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"st')
    cut_log(path, 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
