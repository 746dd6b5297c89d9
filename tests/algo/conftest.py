"""Shared fixtures: a tiny randomly initialised causal LM, built locally."""

from __future__ import annotations

import pytest
import torch

from grpoflow.policy.tiny import build_tiny_model, save_tiny_checkpoint

VOCAB_SIZE = 52


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A directory with a char tokenizer and a tiny Qwen2 model, loadable by `from_pretrained`."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint"))


@pytest.fixture
def tiny_model():
    """A tiny float32 Qwen2 with a 52-token vocabulary."""
    torch.manual_seed(0)
    return build_tiny_model(vocab_size=VOCAB_SIZE)
