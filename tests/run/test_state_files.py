"""A checkpoint's trainer state without pickle: JSON and safetensors, and earlier checkpoints'
`trainer_state.pt` read without running code (CPU)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from grpoflow.run import checkpoint
from grpoflow.run.state_files import LEGACY_STATE_FILE, STATE_FILE, TENSORS_FILE, load_state, save_state


def trained_state() -> dict:
    """A state like a run's: an AdamW step's optimizer state (int keys, tuples), a schedule, every
    RNG, the data position and the config."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    return {
        "step": 3,
        "num_tokens": 1234,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": checkpoint.rng_state(),
        "sampler": {"epoch": 1, "position": 7},
        "seed_generator": torch.Generator().manual_seed(5).get_state(),
        "config": {"model": "tiny", "reward_funcs": ["accuracy"], "beta": 0.0, "stop": None},
        "best_metric": float("-inf"),
        "by_pair": {(1, "a"): [np.float32(0.5), np.arange(3, dtype=np.uint32)]},
    }


def assert_same(got, want) -> None:
    assert type(got) is type(want), (got, want)
    if isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    else:
        assert got == want


def test_a_state_round_trips_through_json_and_safetensors_with_no_pickle(tmp_path):
    state = trained_state()
    save_state(state, tmp_path)
    assert {path.name for path in tmp_path.iterdir()} == {STATE_FILE, TENSORS_FILE}
    loaded = load_state(tmp_path)
    expected = {**state, "by_pair": {(1, "a"): [0.5, state["by_pair"][(1, "a")][1]]}}
    assert_same(loaded, expected)
    optimizer = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    optimizer.load_state_dict(loaded["optimizer"])
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.99)
    checkpoint.set_rng_state(loaded["rng"])


def test_a_state_refuses_what_it_cannot_keep_naming_where(tmp_path):
    with pytest.raises(TypeError, match=r"holds a set at state\.config\.tags"):
        save_state({"config": {"tags": {"a"}}}, tmp_path)


class Payload:
    """A pickle that runs code when loaded: it creates the file it names."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_an_earlier_checkpoint_state_that_would_run_code_is_refused_unrun(tmp_path):
    ran = tmp_path / "ran"
    with open(tmp_path / LEGACY_STATE_FILE, "wb") as file:
        pickle.dump({"step": 1, "payload": Payload(ran)}, file, protocol=2)
    with pytest.raises(ValueError, match=r"trainer_state\.pt holds objects other than tensors"):
        checkpoint.load_trainer_state(tmp_path)
    assert not ran.exists()


def test_an_earlier_checkpoint_state_of_tensors_and_arrays_still_loads(tmp_path):
    state = trained_state()
    del state["by_pair"]
    torch.save(state, tmp_path / LEGACY_STATE_FILE)
    assert_same(checkpoint.load_trainer_state(tmp_path), state)
