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


@pytest.mark.parametrize("alike", [False, True])
def test_a_lora_policys_layers_trace_one_graph_when_marked_alike(alike):
    """Frozen embeddings hand the first layer an input that needs no grad, the others one that
    does: two graphs for one layer code, unless the embeddings' output is marked."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from grpoflow.algo import sequence_logprobs
    from grpoflow.policy.compiling import trace_every_layer_alike
    from grpoflow.policy.lora import AdapterConfig, add_lora
    from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model

    model = build_preset_model("tiny", len(build_char_tokenizer()), seed=3, dtype=torch.float32, device="cpu")
    for layer in model.model.layers:
        layer.compile(backend="eager", dynamic=True)
    model = add_lora(model, AdapterConfig(train_type="lora", lora_rank=4)).train()
    if alike:
        trace_every_layer_alike(model)
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 40, (3, 12))
    sequence_logprobs(model, ids, torch.ones_like(ids), logits_to_keep=4)[0].sum().backward()
    assert counters["stats"]["unique_graphs"] == (1 if alike else 2)
    with torch.no_grad():
        assert not model.get_input_embeddings()(ids).requires_grad
