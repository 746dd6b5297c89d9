"""`grpoflow serve --engine vllm --enable-lora` on the CPU (vllm-cpu): a LoRA trainer's first sync
brings the base with the adapters, every later one the adapters alone, which vLLM serves over the
base it holds; the rollouts equal the merged policy's. Adapters the server cannot serve are
refused whole, and a trainer whose adapters it cannot take sends the merged weights.

The served model is the tiny Qwen2 of head_dim 64 that vLLM's CPU attention takes, saved as a
user's checkpoint (seed 42); the trainer's policy has other base weights (seed 1), so only a sync
that carried the base can match it.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("peft")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import httpx  # noqa: E402
from helpers import support  # noqa: E402
from safetensors.torch import save  # noqa: E402

from grpoflow.engines import EngineConfig, EngineOptions, SamplingParams, build_engine  # noqa: E402
from grpoflow.policy.lora import AdapterConfig, add_lora, generation_model, merged_rollout_weights  # noqa: E402
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpoflow.remote.engine import RemoteEngine  # noqa: E402
from grpoflow.server import ServeConfig, build_service, vllm_backend  # noqa: E402
from grpoflow.transport import WeightSyncError  # noqa: E402
from grpoflow.transport.adapters import is_adapter_name  # noqa: E402

SHAPE = support.VLLM_TINY_SHAPE
PROMPTS = [[5, 6, 7, 8], [20, 21], [30, 31, 32]]
GREEDY = SamplingParams(n=1, max_tokens=8, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(n=2, max_tokens=6, temperature=0.8, ignore_eos=True, seed=5)
MAX_LORA_RANK = 8
LOGPROB_TOLERANCE = 2e-3
"""vLLM's CPU kernels (and its LoRA products) and the native engine's differ in summation order."""
Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def server(vllm_model_dir, serve_live):
    config = ServeConfig(
        model=str(vllm_model_dir),
        engine="vllm",
        device="cpu",
        max_model_len=256,
        max_num_seqs=32,
        enforce_eager=True,
        batch_window_ms=1.0,
        enable_lora=True,
        max_lora_rank=MAX_LORA_RANK,
    )
    live = serve_live(build_service(config))
    yield live
    live.stop()


@pytest.fixture
def received(server, monkeypatch):
    """The names and bytes of every update the server's engine is handed, in order."""
    engine, updates = server.service.engine, []
    load = engine.update_weights

    def recorded(weights, version):
        weights = list(weights)
        updates.append(({name for name, _ in weights}, sum(nbytes(t) for _, t in weights)))
        return load(weights, version)

    monkeypatch.setattr(engine, "update_weights", recorded)
    return updates


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def base_model() -> torch.nn.Module:
    """The trainer's base: the served shape with other weights than the server starts from."""
    return build_tiny_model(len(build_char_tokenizer()), seed=1, **SHAPE).eval()


def lora_policy(rank: int = 4, **adapter) -> torch.nn.Module:
    policy = add_lora(base_model(), AdapterConfig(lora_rank=rank, lora_dropout=0.0, **adapter)).eval()
    train_adapters(policy, seed=2)
    return policy


def train_adapters(policy: torch.nn.Module, seed: int) -> None:
    """Stand-in for an optimizer step: new, non-zero adapter weights."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_" in name:
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))


def merged(policy: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(policy).merge_and_unload().eval()


def remote(url: str, policy: torch.nn.Module, transfer: str = "checkpoint") -> RemoteEngine:
    """The trainer's engine for `policy`, as `grpoflow train` builds it."""
    return RemoteEngine(
        [url],
        startup_timeout=60,
        weight_transfer=transfer,
        weight_sync_timeout=120,
        model=generation_model(policy),
    )


def sync(engine: RemoteEngine, policy: torch.nn.Module, version: int) -> list[str]:
    """What the run sends after an update; returns the names sent."""
    weights = list(merged_rollout_weights(policy, engine))
    engine.update_weights(weights, version)
    return [name for name, _ in weights]


def rollouts(engine, params: SamplingParams = GREEDY) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for group in engine.generate(PROMPTS, params) for c in group]


def local_greedy(model: torch.nn.Module) -> list[tuple[list[int], list[float]]]:
    """Greedy rollouts of a plain model, by the native engine here."""
    options = EngineOptions(engine=EngineConfig(max_model_len=64))
    return rollouts(build_engine("native", model, build_char_tokenizer(), options))


def assert_same(got, want) -> None:
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, got_logprobs), (_, want_logprobs) in zip(got, want):
        torch.testing.assert_close(
            torch.tensor(got_logprobs), torch.tensor(want_logprobs), atol=LOGPROB_TOLERANCE, rtol=0
        )


def assert_changed(got, before) -> None:
    """The first token's log-prob moved for every prompt."""
    assert all(abs(g[0] - b[0]) > 1e-2 for (_, g), (_, b) in zip(got, before))


def assert_sampled_logprobs_match(got, model: torch.nn.Module, temperature: float) -> None:
    """Each sampled completion's log-probs are log_softmax(logits / temperature) of `model`."""
    prompts = [prompt for prompt in PROMPTS for _ in range(len(got) // len(PROMPTS))]
    for prompt, (ids, logprobs) in zip(prompts, got, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits.float() / temperature, -1).gather(1, torch.tensor(ids)[:, None])
        torch.testing.assert_close(torch.tensor(logprobs), want.squeeze(1), atol=LOGPROB_TOLERANCE, rtol=0)


def served_greedy(url: str) -> list[tuple[list[int], list[float]]]:
    body = {"prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    choices = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=120)
    ordered = sorted(choices.json()["choices"], key=lambda choice: choice["index"])
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in ordered]


def update_over_http(url: str, weights: dict[str, torch.Tensor]) -> httpx.Response:
    return httpx.post(
        url + "/update_weights",
        content=save({name: tensor.contiguous() for name, tensor in weights.items()}),
        headers={"Content-Type": "application/octet-stream"},
        timeout=120,
    )


def adapter(module: str, rank: int, out_features: int = 128, in_features: int = 128, up_rank=None):
    """A and B of a non-zero adapter of `module` (B's rank `up_rank` when given)."""
    return {
        f"{module}.lora_A.weight": torch.full((rank, in_features), 0.01),
        f"{module}.lora_B.weight": torch.full((out_features, up_rank or rank), 0.01),
    }


def test_the_server_offers_adapter_updates_up_to_its_max_rank(server):
    info = httpx.get(server.url + "/server_info").json()["grpoflow"]
    assert info["engine"] == "vllm"
    assert info["adapter_updates"] is True and info["max_lora_rank"] == MAX_LORA_RANK
    assert server.service.engine.capabilities.adaptable_modules == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip


@pytest.mark.parametrize("transfer", ["checkpoint", "collective"])
def test_after_the_base_only_adapters_are_sent_and_vllm_generates_the_merged_policy(
    server, received, transfer
):
    policy = lora_policy()
    engine = remote(server.url, policy, transfer)
    try:
        assert engine.capabilities.accepts_adapters and not engine.holds_base
        full = sum(nbytes(tensor) for tensor in merged(policy).state_dict().values())
        first = sync(engine, policy, 1)
        assert any(not is_adapter_name(name) for name in first)  # the base, unmerged
        assert received[-1][0] == set(first)
        got = rollouts(engine)
        assert_same(got, local_greedy(merged(policy)))
        assert_changed(got, local_greedy(base_model()))  # the adapters are in the rollouts

        train_adapters(policy, seed=3)
        second = sync(engine, policy, 2)
        names, sent = received[-1]
        lora = {name: p for name, p in policy.named_parameters() if "lora_" in name}
        assert names == set(second) and all(map(is_adapter_name, names)) and len(names) == len(lora)
        assert sent == sum(map(nbytes, lora.values())) and sent < full / 10, (sent, full)
        again = rollouts(engine)
        assert_same(again, local_greedy(merged(policy)))
        assert_changed(again, got)
        assert_sampled_logprobs_match(rollouts(engine, SAMPLED), merged(policy), SAMPLED.temperature)
        assert httpx.get(server.url + "/weight_info").json() == {"weight_version": "2"}
    finally:
        engine.close()


def test_adapters_the_server_cannot_serve_are_refused_whole(server):
    before = served_greedy(server.url)
    refusals = {
        "above this server's --max-lora-rank 8": adapter(Q_PROJ, 16),
        "B's columns and A's rows are the adapter's rank and must agree": adapter(Q_PROJ, 4, up_rank=3),
        "not a linear layer": adapter("model.layers.0.self_attn.nowhere", 4),
        "lm_head cannot carry a LoRA adapter": adapter(
            "lm_head", 4, out_features=server.service.limits.vocab_size
        ),
    }
    for message, weights in refusals.items():
        response = update_over_http(server.url, {**adapter("model.layers.1.mlp.up_proj", 4, 256), **weights})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    assert served_greedy(server.url) == before  # nothing was applied, and vLLM still generates


def test_a_trainer_whose_rank_is_above_the_servers_sends_the_merged_weights(server, received):
    policy = lora_policy(rank=16)
    engine = remote(server.url, policy)
    try:
        assert not engine.capabilities.accepts_adapters
        for version in (1, 2):
            names = sync(engine, policy, version)
            assert not any(map(is_adapter_name, names)) and received[-1][0] == set(names)
            assert_same(rollouts(engine), local_greedy(merged(policy)))  # the adapter was dropped
            train_adapters(policy, seed=version + 3)
    finally:
        engine.close()


def test_the_trainer_runs_lora_steps_sending_the_adapters_alone(server, received, vllm_model_dir, tmp_path):
    from grpoflow.run.build import build_trainer, run

    config = support.recipe(
        tmp_path,
        model=str(vllm_model_dir),
        max_steps=2,
        train_type="lora",
        lora_rank=4,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server.url,
    )
    trainer = build_trainer(config)
    try:
        assert trainer.engine.capabilities.accepts_adapters
        history = run(config, trainer)
    finally:
        trainer.engine.close()
    assert len(history) == 2 and len(received) >= 2
    assert any(not is_adapter_name(name) for name in received[0][0])
    assert all(all(map(is_adapter_name, names)) for names, _ in received[1:])
    # The post-sync check compared the server's log-probs with the trainer's LoRA policy.
    assert all(0 <= step["sync/check_logprob_gap"] < 1e-2 for step in history)
    trainer.model.eval()
    assert_same(served_greedy(server.url), local_greedy(merged(trainer.model)))


def test_a_server_without_enable_lora_offers_none_and_gets_the_merged_weights(vllm_model_dir, serve_live):
    config = ServeConfig(
        model=str(vllm_model_dir), engine="vllm", device="cpu", max_model_len=256, enforce_eager=True
    )
    live = serve_live(build_service(config))
    try:
        info = httpx.get(live.url + "/server_info").json()["grpoflow"]
        assert info["adapter_updates"] is False and info["max_lora_rank"] is None
        refused = update_over_http(live.url, adapter(Q_PROJ, 4))
        assert refused.status_code == 400 and "--enable-lora" in refused.json()["error"]["message"]
        policy = lora_policy()
        engine = remote(live.url, policy)
        try:
            assert not engine.capabilities.accepts_adapters
            for version in (1, 2):
                names = sync(engine, policy, version)
                assert not any(map(is_adapter_name, names))
                assert_same(rollouts(engine), local_greedy(merged(policy)))
                train_adapters(policy, seed=version + 5)
            with pytest.raises(WeightSyncError, match="does not take"):
                engine.update_weights(adapter(Q_PROJ, 4).items(), 3)
        finally:
            engine.close()
    finally:
        live.stop()


def test_a_max_lora_rank_vllm_does_not_serve_is_refused_before_loading():
    config = ServeConfig(model="tiny", engine="vllm", device="cpu", enable_lora=True, max_lora_rank=600)
    with pytest.raises(ValueError, match="--max-lora-rank=600 is above the largest rank vLLM serves"):
        vllm_backend.prepare(config, build_char_tokenizer())
