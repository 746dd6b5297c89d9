"""The colocated vLLM engine taking a LoRA policy's adapters alone (vLLM's own LoRA support, on
the CPU): the same rollouts as the merged policy, with only the adapters sent after the first sync."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("peft")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from helpers.vllm_reference import assert_rollouts_match_merged, tiny_base, train_adapters  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from grpoflow.engines import EngineConfig, EngineOptions, build_engine  # noqa: E402
from grpoflow.engines.vllm import VLLMConfig, adapter_sync_rank  # noqa: E402
from grpoflow.engines.vllm_adapters import PEFT_PREFIX, AdapterSlot, vllm_max_lora_rank  # noqa: E402
from grpoflow.policy.lora import (  # noqa: E402
    AdapterConfig,
    add_lora,
    generation_model,
    merged_rollout_weights,
)
from grpoflow.transport import in_process  # noqa: E402
from grpoflow.transport.adapters import is_adapter_name  # noqa: E402


@pytest.fixture(scope="module")
def lora_engine():
    base, tokenizer = tiny_base()
    policy = add_lora(base, AdapterConfig(lora_rank=4, lora_dropout=0.0)).eval()
    train_adapters(policy, seed=1)
    options = EngineOptions(engine=EngineConfig(max_model_len=128), vllm=VLLMConfig(vllm_enforce_eager=True))
    engine = build_engine("vllm", generation_model(policy), tokenizer, options)
    yield engine, policy
    engine.close()


def test_first_sync_brings_the_base_then_rollouts_equal_the_merged_policy(lora_engine):
    engine, policy = lora_engine
    assert engine.capabilities.accepts_adapters and not engine.holds_base
    weights = list(merged_rollout_weights(policy, engine))
    assert any(not is_adapter_name(name) for name, _ in weights)  # the unmerged base
    engine.update_weights(weights, version=1)
    assert engine.holds_base and engine.adapters.request is not None
    assert_rollouts_match_merged(engine, policy)


def test_later_syncs_send_only_the_adapters_under_a_new_request(lora_engine, monkeypatch):
    engine, policy = lora_engine
    if not engine.holds_base:
        engine.update_weights(merged_rollout_weights(policy, engine), version=1)
    pushed = []
    monkeypatch.setattr(in_process, "push", lambda llm, weights, **_: pushed.append(list(weights)))
    before = engine.adapters.request.lora_int_id
    train_adapters(policy, seed=2)
    weights = list(merged_rollout_weights(policy, engine))
    adapter_parameters = [p for name, p in policy.named_parameters() if "lora_" in name]
    assert all(is_adapter_name(name) for name, _ in weights)
    assert len(weights) == len(adapter_parameters)
    sent_bytes = sum(tensor.numel() * tensor.element_size() for _, tensor in weights)
    assert sent_bytes == sum(p.numel() * p.element_size() for p in adapter_parameters)
    engine.update_weights(weights, version=2)
    assert pushed == [] and engine.policy_version == 2
    assert engine.adapters.request.lora_int_id > before
    assert_rollouts_match_merged(engine, policy)


def test_modules_to_save_or_the_option_off_keep_the_merged_full_sync_and_say_so(caplog):
    base, _ = tiny_base()
    policy = add_lora(base, AdapterConfig(lora_rank=4, modules_to_save=["model.norm"]))
    with caplog.at_level(logging.INFO, logger="grpoflow.engines.vllm"):
        assert adapter_sync_rank(generation_model(policy)) is None
    assert "merged weights whole" in caplog.text and "modules_to_save" in caplog.text
    plain, _ = tiny_base()
    assert adapter_sync_rank(plain) is None
    adapted = generation_model(add_lora(plain, AdapterConfig(lora_rank=4)))
    assert adapter_sync_rank(adapted) == 4
    assert adapter_sync_rank(adapted, enable=False) is None  # vllm_enable_lora: false


def test_the_rank_vllm_serves_is_the_smallest_allowed_that_holds_lora_rank():
    assert [vllm_max_lora_rank(rank) for rank in (1, 4, 8, 9, 64)] == [1, 8, 8, 16, 64]
    with pytest.raises(ValueError, match="lora_rank=600"):
        vllm_max_lora_rank(600)


def test_adapters_of_several_ranks_are_written_as_one_rank_padded_with_zeros_and_a_split_pair_refused():
    generator = torch.Generator().manual_seed(0)
    adapters = {
        "model.layers.0.self_attn.q_proj": (torch.randn(4, 8, generator=generator), torch.randn(6, 4)),
        "model.layers.0.self_attn.k_proj": (torch.randn(2, 8, generator=generator), torch.randn(6, 2)),
    }
    slot = AdapterSlot()
    try:
        slot.write(adapters)
        written = load_file(str(slot.directory / "adapter_model.safetensors"))
        assert json.loads((slot.directory / "adapter_config.json").read_text())["r"] == 4
        for module, (down, up) in adapters.items():
            padded_down = written[f"{PEFT_PREFIX}{module}.lora_A.weight"]
            padded_up = written[f"{PEFT_PREFIX}{module}.lora_B.weight"]
            assert padded_down.shape == (4, 8) and padded_up.shape == (6, 4)
            torch.testing.assert_close(padded_up @ padded_down, up @ down)
        with pytest.raises(ValueError, match=r"A \(4, 8\) and B \(6, 3\)"):
            slot.write({"model.layers.0.self_attn.q_proj": (torch.zeros(4, 8), torch.zeros(6, 3))})
    finally:
        slot.close()
