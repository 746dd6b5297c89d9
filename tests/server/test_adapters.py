"""A LoRA policy synced to `grpoflow serve` (native engine): the base once, then the adapters
alone, over both transports; the server then generates what the merged policy generates. Which
servers offer adapters, and when a trainer sends them alone (the vLLM engine's: test_vllm_adapters.py)."""

from __future__ import annotations

import argparse
import copy
import logging

import pytest
import torch
from safetensors.torch import save

pytest.importorskip("peft")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx  # noqa: E402
from helpers import support  # noqa: E402
from helpers.live_server import start_server, tiny_service  # noqa: E402

from grpoflow.engines import EngineConfig, EngineOptions, SamplingParams, build_engine  # noqa: E402
from grpoflow.options import add_flags, from_flags  # noqa: E402
from grpoflow.policy.lora import AdapterConfig, add_lora, merged_rollout_weights, merged_weights  # noqa: E402
from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model  # noqa: E402
from grpoflow.remote.capabilities import ServerOffer, adapters_alone  # noqa: E402
from grpoflow.remote.engine import RemoteEngine  # noqa: E402
from grpoflow.server import ServeConfig  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
GREEDY = SamplingParams(n=1, max_tokens=10, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(n=2, max_tokens=10, temperature=0.8, ignore_eos=True, seed=5)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with support.serve_in_subprocess(tmp_path_factory.mktemp("server")) as served:
        yield served


def lora_policy(**adapter) -> torch.nn.Module:
    """The served `tiny` shape with other weights (seed 1; the server's are seed 42) and non-zero
    adapters (PEFT draws A from the global generator: seeded, so tests run before do not choose it)."""
    base = build_preset_model("tiny", len(build_char_tokenizer()), seed=1).eval()
    torch.manual_seed(3)
    policy = add_lora(base, AdapterConfig(lora_rank=4, lora_dropout=0.0, **adapter))
    perturb(policy, seed=2)
    return policy


def perturb(policy: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in policy.parameters():
            if parameter.requires_grad:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))


def merged_model(policy: torch.nn.Module) -> torch.nn.Module:
    plain = copy.deepcopy(build_preset_model("tiny", len(build_char_tokenizer()), seed=1)).eval()
    plain.load_state_dict(dict(merged_weights(policy)), strict=False)
    return plain


def rollouts(engine, params: SamplingParams) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for group in engine.generate(PROMPTS, params) for c in group]


def local(policy: torch.nn.Module, params: SamplingParams):
    options = EngineOptions(engine=EngineConfig(max_model_len=64))
    return rollouts(build_engine("native", merged_model(policy), build_char_tokenizer(), options), params)


def assert_same(got, want) -> None:
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, got_logprobs), (_, want_logprobs) in zip(got, want):
        torch.testing.assert_close(
            torch.tensor(got_logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=1e-4
        )


def sync(engine: RemoteEngine, policy: torch.nn.Module, version: int) -> int:
    """What the run sends after an update; returns the bytes sent."""
    weights = list(merged_rollout_weights(policy, engine))
    engine.update_weights(weights, version)
    return sum(tensor.numel() * tensor.element_size() for _, tensor in weights)


@pytest.mark.parametrize("transfer", ["checkpoint", "collective"])
def test_after_the_base_only_adapters_are_sent_and_the_server_generates_the_merged_policy(url, transfer):
    policy = lora_policy(modules_to_save=["model.norm"])
    engine = RemoteEngine([url], startup_timeout=60, weight_transfer=transfer, weight_sync_timeout=60)
    try:
        assert engine.capabilities.accepts_adapters and not engine.holds_base
        full = sum(t.numel() * t.element_size() for _, t in merged_weights(policy))
        first = sync(engine, policy, 1)
        assert engine.holds_base and first > full  # the base, and the adapters beside it
        for params in (GREEDY, SAMPLED):
            assert_same(rollouts(engine, params), local(policy, params))
        for version in (2, 3):
            perturb(policy, seed=version)
            sent = sync(engine, policy, version)
            assert sent < full / 4, (sent, full)
            for params in (GREEDY, SAMPLED):
                assert_same(rollouts(engine, params), local(policy, params))
    finally:
        engine.close()


def test_adapters_for_a_layer_the_model_lacks_are_refused_whole():
    server = start_server(tiny_service())
    try:
        engine = RemoteEngine([server.url], startup_timeout=30, weight_transfer="checkpoint")
        bad = {"model.layers.0.self_attn.nowhere.lora_A.weight": torch.zeros(4, 64)}
        bad["model.layers.0.self_attn.nowhere.lora_B.weight"] = torch.zeros(64, 4)
        with pytest.raises(Exception, match="not a linear layer"):
            engine.update_weights(list(bad.items()), 1)
        wrong_rank = {
            "model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
            "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 3),
        }
        with pytest.raises(Exception, match="rank and must agree"):
            engine.update_weights(list(wrong_rank.items()), 1)
        engine.close()
    finally:
        server.stop()


def test_enable_lora_is_a_flag_of_the_vllm_engine_alone():
    parser = argparse.ArgumentParser()
    add_flags(parser, ServeConfig)
    flags = ["--model", "DIR", "--engine", "vllm", "--enable-lora", "--max-lora-rank", "32"]
    config = from_flags(ServeConfig, parser.parse_args(flags))
    assert config.enable_lora and config.max_lora_rank == 32
    assert not ServeConfig(model="DIR", engine="vllm").enable_lora  # off unless asked
    with pytest.raises(ValueError, match="--enable-lora must be off with --engine native"):
        ServeConfig(model="tiny", enable_lora=True)
    with pytest.raises(ValueError, match="--max-lora-rank must be >= 1"):
        ServeConfig(model="DIR", engine="vllm", enable_lora=True, max_lora_rank=0)


def test_an_engine_without_adapters_does_not_offer_them_and_refuses_them_by_name():
    server = start_server(tiny_service(engine="hf"))
    try:
        info = httpx.get(server.url + "/server_info").json()["grpoflow"]
        assert info["adapter_updates"] is False and info["max_lora_rank"] is None
        body = save({"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)})
        answer = httpx.post(
            server.url + "/update_weights", content=body, headers={"Content-Type": "application/octet-stream"}
        )
        message = answer.json()["error"]["message"]
        assert answer.status_code == 400 and "does not take" in message and "--enable-lora" in message
    finally:
        server.stop()


def offer(name: str, *, adapters: bool = True, engine: str = "native", max_lora_rank=None) -> ServerOffer:
    return ServerOffer(name, "m", None, False, "cpu", adapters, engine, max_lora_rank)


def test_adapters_go_alone_only_to_servers_that_take_the_policys(caplog):
    policy, saved = lora_policy(), lora_policy(modules_to_save=["model.norm"])
    native, vllm = offer("native"), offer("vllm", engine="vllm", max_lora_rank=8)
    with caplog.at_level(logging.INFO, logger="grpoflow.remote"):
        assert adapters_alone([native, vllm], policy)
        assert "adapters alone" in caplog.text
        assert adapters_alone([native], saved)  # the native engine loads modules_to_save too
        caplog.clear()
        assert not adapters_alone([native, offer("small", engine="vllm", max_lora_rank=1)], policy)
        assert "rank 4 is above the --max-lora-rank of server(s) small (1)" in caplog.text
        assert not adapters_alone([vllm], saved)
        assert "modules_to_save" in caplog.text
        assert not adapters_alone([native, offer("plain", adapters=False)], policy)
        assert "server(s) plain take no LoRA adapters" in caplog.text
    assert adapters_alone([native, vllm]) and not adapters_alone([offer("plain", adapters=False)])


Q_PROJ = "model.layers.0.self_attn.q_proj"


def post_weights(url: str, tensors: dict[str, torch.Tensor]) -> httpx.Response:
    headers = {"Content-Type": "application/octet-stream"}
    return httpx.post(url + "/update_weights", content=save(tensors), headers=headers, timeout=60)


def low_rank(rank: int, up_rank: int | None = None, scale: float = 0.1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return {
        f"{Q_PROJ}.lora_A.weight": scale * torch.randn(rank, 64, generator=generator),
        f"{Q_PROJ}.lora_B.weight": scale * torch.randn(64, up_rank or rank, generator=generator),
    }


def test_the_native_server_takes_adapters_up_to_max_lora_rank():
    assert ServeConfig(model="tiny").max_lora_rank == 64
    server = start_server(tiny_service(max_lora_rank=8))
    try:
        info = httpx.get(server.url + "/server_info").json()["grpoflow"]
        assert info["adapter_updates"] is True and info["max_lora_rank"] == 8
        refused = post_weights(server.url, low_rank(16))
        message = refused.json()["error"]["message"]
        assert refused.status_code == 400 and "rank 16, above this server's --max-lora-rank 8" in message
        assert server.service.engine.family.loaded == {}
        assert post_weights(server.url, low_rank(8)).status_code == 200
        assert list(server.service.engine.family.loaded) == [Q_PROJ]
    finally:
        server.stop()


def test_an_unpaired_or_mismatched_adapter_is_a_400_naming_the_tensor():
    server = start_server(tiny_service())
    try:
        down, up = low_rank(4)
        for given, missing in ((down, up), (up, down)):
            answer = post_weights(server.url, {given: low_rank(4)[given]})
            message = answer.json()["error"]["message"]
            assert answer.status_code == 400 and f"but not {missing}" in message, message
        answer = post_weights(server.url, low_rank(4, up_rank=3))
        message = answer.json()["error"]["message"]
        assert answer.status_code == 400 and f"{up} has 3 columns, {down} 4 rows" in message, message
        assert server.service.engine.family.loaded == {}
    finally:
        server.stop()


def test_adapters_of_absurd_magnitude_are_refused():
    server = start_server(tiny_service())
    try:
        # Each half beyond its layer's bound; or each within it, but the change they make beyond.
        for scale, refused in ((1e5, "lora_A.weight holds"), (1e3, "can change a weight by up to")):
            answer = post_weights(server.url, low_rank(4, scale=scale))
            message = answer.json()["error"]["message"]
            assert answer.status_code == 400 and Q_PROJ in message and "beyond" in message, message
            assert refused in message and "nothing was applied" in message
        assert server.service.engine.family.loaded == {}
        assert post_weights(server.url, low_rank(4, scale=1.0)).status_code == 200
    finally:
        server.stop()


def test_merged_weights_after_adapters_leave_the_native_server_without_them():
    policy = lora_policy()
    server = start_server(tiny_service())
    engine = RemoteEngine(
        [server.url], startup_timeout=30, weight_transfer="collective", weight_sync_timeout=60
    )
    try:
        sync(engine, policy, 1)
        assert server.service.engine.family.loaded  # the base, with the adapters beside it
        engine.update_weights(list(merged_weights(policy)), 2)  # the policy merged: a base reload
        assert server.service.engine.family.loaded == {}
        assert_same(rollouts(engine, GREEDY), local(policy, GREEDY))
    finally:
        engine.close()
        server.stop()
