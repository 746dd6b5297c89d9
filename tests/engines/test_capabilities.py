"""Every engine states its capabilities in one record, and its consumers read that record: an
engine that declares no adapters is refused them, whatever attributes it carries."""

from __future__ import annotations

import importlib
import typing

import pytest
import torch
from helpers.native_fixtures import one_thread  # noqa: F401 (a fixture)

from grpoflow.engines import (
    ENGINES,
    EngineCapabilities,
    EngineConfig,
    EngineOptions,
    RolloutEngine,
    build_engine,
)
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model
from grpoflow.transport import ReceiveError

PROTOCOL_METHODS = ("generate", "update_weights", "sleep", "wake_up", "reset_prefix_cache", "close")


def engine_class(name: str) -> type:
    """The class the registry's factory for `name` builds, read from its return annotation."""
    module_name, _, factory_name = ENGINES[name].partition(":")
    factory = vars(importlib.import_module(module_name))[factory_name]
    return typing.get_type_hints(factory)["return"]


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_registered_engine_class_declares_its_capabilities_and_the_protocol(name):
    cls = engine_class(name)
    assert typing.get_type_hints(cls)["capabilities"] is EngineCapabilities
    assert all(callable(vars(cls).get(method)) for method in PROTOCOL_METHODS), cls.__name__


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.mark.parametrize("name", ["hf", "native"])
def test_an_in_process_engine_names_itself_and_offers_its_module_for_hosting(name, tokenizer):
    model = build_tiny_model(len(tokenizer), model_type="llama")
    engine = build_engine(name, model, tokenizer, EngineOptions(engine=EngineConfig(max_model_len=64)))
    capabilities = engine.capabilities
    assert isinstance(engine, RolloutEngine) and capabilities.name == name
    assert capabilities.module is model and capabilities.model_dir is None and capabilities.servers == ()
    native = name == "native"
    assert capabilities.accepts_adapters == capabilities.applies_adapters == native
    assert capabilities.per_prompt_params == capabilities.aborts == capabilities.prefix_cache == native


def test_the_native_engines_generic_path_takes_no_adapters_and_caches_no_prefix(tokenizer):
    model = build_tiny_model(len(tokenizer), model_type="llama")
    engine = NativeEngine(model, config=NativeEngineConfig(force_generic=True), tokenizer=tokenizer)
    capabilities = engine.capabilities
    assert capabilities.applies_adapters and capabilities.per_prompt_params and capabilities.aborts
    assert not capabilities.accepts_adapters and not capabilities.prefix_cache


class DeclaredEngine:
    """An engine that is nothing but its declarations; it carries the attributes an engine once
    announced adapters with, which no consumer reads any more."""

    shares_policy_weights, holds_base, policy_version = False, False, 0
    accepts_adapters = max_adapter_rank = True

    def __init__(self, **capabilities) -> None:
        self.capabilities = EngineCapabilities(name="declared", **capabilities)


ADAPTER = "model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def service():
    from helpers.live_server import tiny_service

    return tiny_service()


def adapter_update(service) -> dict[str, tuple[int, int]]:
    out_features, in_features = service.model.get_submodule(
        ADAPTER.removesuffix(".lora_A.weight")
    ).weight.shape
    return {ADAPTER: (4, in_features), ADAPTER.replace("lora_A", "lora_B"): (out_features, 4)}


def test_a_server_refuses_adapters_to_an_engine_that_declares_none(service):
    service.engine = DeclaredEngine()
    with pytest.raises(ReceiveError, match="does not take"):
        service.update_shapes(adapter_update(service))


def test_a_server_checks_adapters_against_the_declared_rank_and_modules(service):
    service.engine = DeclaredEngine(accepts_adapters=True, max_adapter_rank=2)
    with pytest.raises(ReceiveError, match="above this server's --max-lora-rank 2"):
        service.update_shapes(adapter_update(service))
    service.engine = DeclaredEngine(accepts_adapters=True, adaptable_modules=frozenset({"v_proj"}))
    with pytest.raises(ReceiveError, match="cannot carry a LoRA adapter"):
        service.update_shapes(adapter_update(service))
    service.engine = DeclaredEngine(accepts_adapters=True, max_adapter_rank=4)
    assert service.update_shapes(adapter_update(service))[ADAPTER] == adapter_update(service)[ADAPTER]


def test_the_batcher_calls_generate_as_the_engine_declares():
    from grpoflow.server.batcher import Batcher

    plain = Batcher(DeclaredEngine())
    native = Batcher(DeclaredEngine(per_prompt_params=True, aborts=True))
    assert (plain.per_prompt, plain.abortable, native.per_prompt, native.abortable) == (
        False,
        False,
        True,
        True,
    )


def test_hosting_exposes_the_declared_module_and_refuses_an_engine_on_servers():
    from grpoflow.server.hosted import served_module

    module = torch.nn.Linear(2, 2)
    assert served_module(DeclaredEngine(module=module)) is module
    with pytest.raises(ValueError, match="cannot be hosted"):
        served_module(DeclaredEngine(servers=(("http://127.0.0.1:8000", "policy"),)))
