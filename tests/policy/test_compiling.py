"""torch.compile of the policy's layers: Inductor's caches kept in grpoflow's cache directory
unless the user set them, and a chosen (not given) compile that cannot apply trains uncompiled."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from grpoflow.policy.compiling import (
    CACHE_DIR_ENV,
    FX_GRAPH_CACHE_ENV,
    compile_layers,
    persist_inductor_caches,
)


def test_inductor_caches_persist_in_grpoflows_cache_dir(tmp_path):
    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    persist_inductor_caches(environ)
    assert environ[CACHE_DIR_ENV] == str(tmp_path / "grpoflow" / "inductor")
    assert environ[FX_GRAPH_CACHE_ENV] == "1"
    home = {}
    persist_inductor_caches(home)
    assert home[CACHE_DIR_ENV] == str(Path.home() / ".cache" / "grpoflow" / "inductor")


def test_the_users_inductor_settings_stay(tmp_path):
    environ = {CACHE_DIR_ENV: "/elsewhere", FX_GRAPH_CACHE_ENV: "0", "XDG_CACHE_HOME": str(tmp_path)}
    persist_inductor_caches(environ)
    assert environ[CACHE_DIR_ENV] == "/elsewhere" and environ[FX_GRAPH_CACHE_ENV] == "0"


def test_a_chosen_compile_falls_back_with_one_line(caplog):
    model = torch.nn.Linear(2, 2)  # no model.layers
    with pytest.raises(ValueError, match="torch_compile needs a model with model.layers"):
        compile_layers(model)
    with caplog.at_level(logging.WARNING, logger="grpoflow.policy.compiling"):
        assert compile_layers(model, fallback=True) is False
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "torch_compile needs a model with model.layers (Llama-style decoders): training uncompiled"
    ]
