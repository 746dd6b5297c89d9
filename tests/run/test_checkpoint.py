import random

import numpy as np
import pytest
import torch

from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model
from grpoflow.run.checkpoint import (
    MARKER,
    STATE_FILE,
    checkpoint_run_id,
    checkpoint_step,
    list_checkpoints,
    load_trainer_state,
    resolve_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from grpoflow.run.state_files import load_state, save_state


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1)


class CrashingModel:
    """Writes part of its weights, then fails, as a process killed mid-save would leave them."""

    def save_pretrained(self, directory, **kwargs):
        (directory / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")


def save(output_dir, step, model, tokenizer, **kwargs):
    return save_checkpoint(
        output_dir, step, model=model, tokenizer=tokenizer, trainer_state={"step": step}, **kwargs
    )


def test_save_writes_a_complete_directory(tmp_path, model, tokenizer):
    path = save(tmp_path / "run", 5, model, tokenizer)
    assert path == tmp_path / "run" / "checkpoint-5"
    names = {child.name for child in path.iterdir()}
    assert {MARKER, STATE_FILE, "config.json", "model.safetensors", "tokenizer.json"} <= names
    assert checkpoint_step(path) == 5 and checkpoint_run_id(path) is None
    assert load_trainer_state(path) == {"step": 5}
    assert list(path.parent.glob(".tmp-checkpoint-*")) == []
    assert resolve_checkpoint(str(path), tmp_path / "run") == path


def test_saved_weights_load_back(tmp_path, model, tokenizer):
    from transformers import AutoModelForCausalLM

    path = save(tmp_path, 1, model, tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(path)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)


def test_a_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, model, tokenizer):
    good = save(tmp_path, 10, model, tokenizer)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 20, CrashingModel(), tokenizer)
    assert not (tmp_path / "checkpoint-20").exists()
    assert len(list(tmp_path.glob(".tmp-checkpoint-20-*"))) == 1
    assert list_checkpoints(tmp_path) == [good]
    assert resolve_checkpoint("latest", tmp_path) == good


def test_the_next_save_clears_stale_temporary_directories(tmp_path, model, tokenizer):
    stale = tmp_path / ".tmp-checkpoint-7-12345"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    assert list_checkpoints(tmp_path) == []
    path = save(tmp_path, 8, model, tokenizer)
    assert not stale.exists()
    assert list_checkpoints(tmp_path) == [path]


def test_directories_without_the_marker_are_not_checkpoints(tmp_path, model, tokenizer):
    good = save(tmp_path, 3, model, tokenizer)
    (tmp_path / "checkpoint-9").mkdir()  # e.g. copied by hand, half-way
    (tmp_path / "checkpoint-9" / STATE_FILE).write_text("{}")
    (tmp_path / "checkpoint-last").mkdir()
    (tmp_path / "checkpoint-last" / MARKER).write_text("x")
    assert list_checkpoints(tmp_path) == [good]
    assert resolve_checkpoint("latest", tmp_path) == good
    with pytest.raises(ValueError, match="is not a complete checkpoint directory"):
        resolve_checkpoint(str(tmp_path / "checkpoint-9"), tmp_path)


def test_checkpoints_sort_by_step_number_not_name(tmp_path, model, tokenizer):
    for step in (9, 10, 100):
        save(tmp_path, step, model, tokenizer)
    assert [path.name for path in list_checkpoints(tmp_path)] == [
        "checkpoint-9",
        "checkpoint-10",
        "checkpoint-100",
    ]
    assert resolve_checkpoint("latest", tmp_path).name == "checkpoint-100"


def test_save_total_limit_keeps_the_newest(tmp_path, model, tokenizer):
    for step in (2, 4, 6, 8):
        save(tmp_path, step, model, tokenizer, save_total_limit=2)
    assert [path.name for path in list_checkpoints(tmp_path)] == ["checkpoint-6", "checkpoint-8"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint-6", "checkpoint-8"]


def test_save_total_limit_never_deletes_the_checkpoint_just_written(tmp_path, model, tokenizer):
    # A run resumed from checkpoint-100 while checkpoint-200 of the abandoned run still exists.
    for step in (100, 200):
        save(tmp_path, step, model, tokenizer)
    path = save(tmp_path, 150, model, tokenizer, save_total_limit=2)
    assert path.is_dir()
    assert [path.name for path in list_checkpoints(tmp_path)] == ["checkpoint-150", "checkpoint-200"]
    path = save(tmp_path, 160, model, tokenizer, save_total_limit=1)
    assert list_checkpoints(tmp_path) == [path]


def test_saving_a_step_again_replaces_it(tmp_path, model, tokenizer):
    save_checkpoint(tmp_path, 4, model=model, tokenizer=tokenizer, trainer_state={"v": 1})
    path = save_checkpoint(tmp_path, 4, model=model, tokenizer=tokenizer, trainer_state={"v": 2})
    assert load_trainer_state(path) == {"v": 2}
    assert list_checkpoints(tmp_path) == [path]


@pytest.mark.parametrize("spec", ["latest", "LATEST", "true", "auto"])
def test_resolve_latest(tmp_path, model, tokenizer, spec):
    save(tmp_path, 1, model, tokenizer)
    newest = save(tmp_path, 2, model, tokenizer)
    assert resolve_checkpoint(spec, tmp_path) == newest


def test_resolve_errors(tmp_path):
    with pytest.raises(ValueError, match="no complete checkpoint in"):
        resolve_checkpoint("latest", tmp_path)
    with pytest.raises(ValueError, match="no complete checkpoint in"):
        resolve_checkpoint("latest", tmp_path / "never-created")
    with pytest.raises(ValueError, match=f"needs {MARKER} and {STATE_FILE}"):
        resolve_checkpoint(str(tmp_path / "missing"), tmp_path)
    marker_only = tmp_path / "checkpoint-1"
    marker_only.mkdir()
    (marker_only / MARKER).write_text("1")
    with pytest.raises(ValueError, match="is not a complete checkpoint directory"):
        resolve_checkpoint(str(marker_only), tmp_path)


def draws() -> tuple:
    return (
        random.random(),
        float(np.random.rand()),
        torch.rand(3).tolist(),
        torch.randint(0, 100, (2,)).tolist(),
    )


def test_rng_state_round_trip(tmp_path):
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    draws()
    state = rng_state()
    expected = draws()
    save_state({"rng": state}, tmp_path)  # as it travels inside trainer_state
    draws()  # move every generator on
    assert draws() != expected
    set_rng_state(load_state(tmp_path)["rng"])
    assert draws() == expected
