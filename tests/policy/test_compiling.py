"""torch.compile of the policy's layers: Inductor's caches kept in grpoflow's cache directory
unless the user set them (torch's own default, which importing Inductor's config writes into the
environment, counts as unset), a second run's graphs with custom autograd functions taken from
AOTAutograd's cache, and a chosen (not given) compile that cannot apply trains uncompiled."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.support import clean_env

from grpoflow.policy.compiling import (
    CACHE_DIR_ENV,
    FX_GRAPH_CACHE_ENV,
    cache_key,
    compile_layers,
    inductor_cache_dir,
    persist_inductor_caches,
    torch_default_cache_dir,
)


def test_inductor_caches_persist_in_grpoflows_cache_dir(tmp_path):
    ours = tmp_path / "grpoflow" / "inductor" / cache_key()
    for chosen in ({}, {CACHE_DIR_ENV: torch_default_cache_dir()}):  # torch's default: unset
        environ = {"XDG_CACHE_HOME": str(tmp_path), **chosen}
        assert persist_inductor_caches(environ) == ours
        assert environ[CACHE_DIR_ENV] == str(ours) and environ[FX_GRAPH_CACHE_ENV] == "1"
    home = {}
    persist_inductor_caches(home)
    assert home[CACHE_DIR_ENV] == str(Path.home() / ".cache" / "grpoflow" / "inductor" / cache_key())
    assert len(cache_key()) == 16 and cache_key() == cache_key()
    layer = __file__  # a model's own code names another directory
    assert inductor_cache_dir({}, (layer,)).name == cache_key((layer,)) != cache_key()


def test_the_users_inductor_settings_stay(tmp_path):
    environ = {CACHE_DIR_ENV: "/elsewhere", FX_GRAPH_CACHE_ENV: "0", "XDG_CACHE_HOME": str(tmp_path)}
    assert persist_inductor_caches(environ) is None
    assert environ[CACHE_DIR_ENV] == "/elsewhere" and environ[FX_GRAPH_CACHE_ENV] == "0"


COMPILED_RUN = """
import json
import torch._inductor.config  # writes torch's default cache directory into the environment
import torch
from torch import nn
from torch._dynamo.utils import counters
from grpoflow.policy.compiling import compile_layers
from grpoflow.policy.lora_dropout import DroppedInputLinear


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = DroppedInputLinear(8, 4, bias=False)
        self.down.dropout_p = 0.25  # grpoflow's custom autograd function

    def forward(self, x):
        return x * self.down(x).sum(-1, keepdim=True)


torch.manual_seed(0)
model = nn.Module()
model.model = nn.Module()
model.model.layers = nn.ModuleList([Layer()])
compile_layers(model)
model.model.layers[0](torch.randn(3, 8, requires_grad=True)).sum().backward()
print(json.dumps({**counters["aot_autograd"], "specialize_float": torch._dynamo.config.specialize_float}))
"""


def test_a_second_run_takes_graphs_with_custom_autograd_functions_from_the_cache(tmp_path):
    """Two processes compile a layer whose LoRA dropout is a custom autograd function, after
    importing Inductor's config (which sets TORCHINDUCTOR_CACHE_DIR to torch's /tmp default):
    the first saves its graph under grpoflow's directory, the second loads it, each tracing the
    layer once."""
    env = clean_env(XDG_CACHE_HOME=str(tmp_path))
    for name in (CACHE_DIR_ENV, FX_GRAPH_CACHE_ENV):
        env.pop(name, None)
    runs = []
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-c", COMPILED_RUN], env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert "autograd_cache_bypass" not in first and first.get("autograd_cache_saved", 0) >= 1, first
    assert second.get("autograd_cache_hit", 0) >= 1 and "autograd_cache_bypass" not in second, second
    # One trace each: the dropout probability, a float, is no input that forces a second trace
    # (whose first attempt would miss the cache in every run).
    assert first["total"] == second["total"] == 1 and "autograd_cache_miss" not in second, runs
    assert not first["specialize_float"]  # constant floats for the layers' calls only
    (directory,) = (tmp_path / "grpoflow" / "inductor").iterdir()  # one key: the same code both times
    assert (directory / "aotautograd").is_dir() and len(directory.name) == 16


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


def test_a_micro_batch_as_many_rows_as_a_head_is_wide_traces_the_layers_once():
    """The tiny model's heads are 16 wide: a first micro-batch of 16 rows, then micro-batches of
    other sizes and lengths, run on the graph the first traced; torch's duck sizing stays on for
    other code."""
    import torch._dynamo
    import torch.fx.experimental._config as shape_config
    from torch._dynamo.utils import counters

    from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model

    model = build_preset_model("tiny", len(build_char_tokenizer()), seed=3, dtype=torch.float32, device="cpu")
    assert model.config.hidden_size // model.config.num_attention_heads == 16
    model.config.use_cache = False
    compile_layers(model, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    for rows, length in ((16, 24), (12, 24), (12, 30), (3, 17)):
        model(input_ids=torch.randint(0, 40, (rows, length))).logits.sum().backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert shape_config.use_duck_shape
