"""RemoteEngine with a LoRA policy against vLLM's own OpenAI server on the CPU, started with
--enable-lora and runtime LoRA loading: the first sync brings the base (checkpoint reload) with
the adapters, every later one the adapters alone as a directory the server loads by path; the
rollouts equal the merged policy's. The served checkpoint has other base weights than the policy
(seed 42 against 0), so only a sync that carried the base can match it."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("peft")
pytest.importorskip("httpx")

from helpers import support  # noqa: E402
from helpers.vllm_reference import assert_rollouts_match_merged, tiny_base, train_adapters  # noqa: E402

from grpoflow.policy.lora import AdapterConfig, add_lora, generation_model, merged_rollout_weights  # noqa: E402
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpoflow.remote.engine import RemoteEngine  # noqa: E402
from grpoflow.transport import WeightSyncError  # noqa: E402
from grpoflow.transport.adapters import is_adapter_name  # noqa: E402

MAX_LORA_RANK = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """vLLM's own server in dev mode, LoRA on and loadable at run time; yields its URL."""
    tokenizer = build_char_tokenizer()
    torch.manual_seed(42)
    served = build_tiny_model(len(tokenizer), **support.VLLM_TINY_SHAPE)
    directory = tmp_path_factory.mktemp("served")
    served.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    flags = ("--max-model-len", "128", "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK))
    log_dir = tmp_path_factory.mktemp("server")
    with support.vllm_openai_server(directory, log_dir, *flags, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1") as url:
        yield url


def lora_policy(rank: int = 4):
    base, _ = tiny_base()
    policy = add_lora(base, AdapterConfig(lora_rank=rank, lora_dropout=0.0)).eval()
    train_adapters(policy, seed=1)
    return policy


def served_models(engine: RemoteEngine) -> list[str]:
    return [model["id"] for model in engine.client.request("GET", engine.urls[0], "/v1/models")["data"]]


def test_the_base_once_then_adapters_alone_and_rollouts_equal_the_merged_policy(server, tmp_path):
    policy = lora_policy()
    engine = RemoteEngine([server], startup_timeout=240, sync_dir=tmp_path, model=generation_model(policy))
    try:
        assert engine.capabilities.accepts_adapters and engine.server_adapters is not None
        first = list(merged_rollout_weights(policy, engine))
        assert any(not is_adapter_name(name) for name, _ in first)  # the unmerged base
        engine.update_weights(first, version=1)
        assert_rollouts_match_merged(engine, policy)
        token = engine.server_adapters.token
        assert sorted(path.name for path in tmp_path.iterdir()) == [f"adapter-{token}-v1", "policy-v1"]

        train_adapters(policy, seed=2)
        later = list(merged_rollout_weights(policy, engine))
        assert later and all(is_adapter_name(name) for name, _ in later)
        engine.update_weights(later, version=2)
        assert_rollouts_match_merged(engine, policy)
        # No new checkpoint: the adapters alone, the previous version unloaded and removed.
        assert sorted(path.name for path in tmp_path.iterdir()) == [f"adapter-{token}-v2", "policy-v1"]
        assert f"grpoflow-{token}-v2" in served_models(engine)
        assert f"grpoflow-{token}-v1" not in served_models(engine)
        engine.update_weights(later, version=2)  # a retried sync of the same version
        assert_rollouts_match_merged(engine, policy)

        # Adapters the server cannot load: the sync fails naming what the server needs, and the
        # loaded version keeps serving.
        bad = [(name.replace("q_proj", "no_such_proj"), tensor) for name, tensor in later]
        with pytest.raises(WeightSyncError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
            engine.update_weights(bad, version=3)
        assert_rollouts_match_merged(engine, policy)

        # Merged weights whole: the base serves them again, the adapter is dropped.
        merged = copy.deepcopy(policy).merge_and_unload()
        engine.update_weights(merged.named_parameters(), version=4)
        assert engine.server_adapters.name is None
        assert not any(name.startswith(f"grpoflow-{token}") for name in served_models(engine))
        assert_rollouts_match_merged(engine, policy)
    finally:
        engine.close()


def test_a_rank_above_the_servers_max_lora_rank_sends_merged_weights(server, tmp_path, caplog):
    policy = lora_policy(rank=2 * MAX_LORA_RANK)
    with caplog.at_level("INFO", logger="grpoflow.remote"):
        engine = RemoteEngine(
            [server], startup_timeout=240, sync_dir=tmp_path, model=generation_model(policy)
        )
    try:
        assert not engine.capabilities.accepts_adapters and engine.server_adapters is None
        assert f"above the --max-lora-rank of server(s) {server} ({MAX_LORA_RANK})" in caplog.text
    finally:
        engine.close()
