"""Fixtures of the Python API's tests: the tiny local model a TRL-shaped script trains."""

from __future__ import annotations

import pytest

from grpoflow.policy.tiny import save_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny model and its tokenizer saved as a user's checkpoint directory."""
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_model")))
