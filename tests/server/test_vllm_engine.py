"""`grpoflow serve --engine vllm` on the CPU (vllm-cpu): one vLLM engine for the whole module.

The served model is a tiny Qwen2 with head_dim 64 (vLLM's CPU attention rejects the `tiny`
preset's 16), saved to a directory as a user's checkpoint would be. What the server generates
after an update is checked against grpoflow's native engine running the updated weights here.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import httpx  # noqa: E402
from helpers import support  # noqa: E402
from safetensors.torch import save  # noqa: E402

from grpoflow.engines import EngineConfig, EngineOptions, SamplingParams, build_engine  # noqa: E402
from grpoflow.engines.vllm import VLLMEngine  # noqa: E402
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpoflow.remote.engine import RemoteEngine  # noqa: E402
from grpoflow.server import ServeConfig, build_service, vllm_backend  # noqa: E402
from grpoflow.transport import WeightSyncError  # noqa: E402

TINY_SHAPE = support.VLLM_TINY_SHAPE
PROMPTS = [[5, 6, 7, 8], [20, 21], [30, 31, 32]]
GREEDY = SamplingParams(n=1, max_tokens=8, temperature=0.0, ignore_eos=True)
LOGPROB_TOLERANCE = 2e-3
"""vLLM's CPU kernels and the native engine's differ in summation order."""


def model(seed: int) -> torch.nn.Module:
    """The served model's shape with the weights of `seed` (the server starts from seed 42)."""
    return build_tiny_model(len(build_char_tokenizer()), seed=seed, **TINY_SHAPE).eval()


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
    )
    live = serve_live(build_service(config))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def remote(server):
    engine = RemoteEngine(
        [server.url], startup_timeout=60, weight_transfer="collective", weight_sync_timeout=120
    )
    yield engine
    engine.close()


def local_greedy(policy: torch.nn.Module) -> list[tuple[list[int], list[float]]]:
    """What the server should generate with `policy`'s weights, computed here by the native engine."""
    local = build_engine(
        "native", policy, build_char_tokenizer(), EngineOptions(engine=EngineConfig(max_model_len=64))
    )
    return [(c.token_ids, c.logprobs) for group in local.generate(PROMPTS, GREEDY) for c in group]


def served_greedy(url: str) -> list[tuple[list[int], list[float]]]:
    body = {
        "prompt": PROMPTS,
        "max_tokens": GREEDY.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
    }
    choices = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"]
    choices.sort(key=lambda choice: choice["index"])
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]


def assert_same(got, want) -> None:
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, got_logprobs), (_, want_logprobs) in zip(got, want):
        torch.testing.assert_close(
            torch.tensor(got_logprobs), torch.tensor(want_logprobs), atol=LOGPROB_TOLERANCE, rtol=0
        )


def assert_changed(got, before) -> None:
    """The first token's log-prob moved for every prompt: the weights really changed."""
    assert all(abs(g[0] - b[0]) > 1e-2 for (_, g), (_, b) in zip(got, before))


def safetensors_body(weights: dict[str, torch.Tensor]) -> bytes:
    return save({name: tensor.detach().contiguous() for name, tensor in weights.items()})


def update_over_http(url: str, weights: dict[str, torch.Tensor]) -> httpx.Response:
    return httpx.post(
        url + "/update_weights",
        content=safetensors_body(weights),
        headers={"Content-Type": "application/octet-stream"},
        timeout=120,
    )


def test_the_server_runs_vllm_and_generates_n_completions_with_logprobs(server):
    assert isinstance(server.service.engine, VLLMEngine)
    info = httpx.get(server.url + "/server_info").json()["grpoflow"]
    assert info["engine"] == "vllm" and info["device"] == "cpu"
    assert info["weight_transfer"]["backends"] == ["http", "gloo"]
    body = {
        "prompt": PROMPTS[:2],
        "n": 3,
        "max_tokens": 6,
        "temperature": 0.8,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
        "seed": 5,
    }
    choices = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"]
    assert len(choices) == 6
    reference = model(42)
    for prompt_index, prompt in enumerate(PROMPTS[:2]):
        group = [c for c in choices if c["index"] // 3 == prompt_index]
        assert len({tuple(c["token_ids"]) for c in group}) > 1  # n samples, not one repeated
        for choice in group:
            ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
            assert len(ids) == len(logprobs) == 6 and choice["finish_reason"] == "length"
            torch.testing.assert_close(
                torch.tensor(logprobs), reference_logprobs(reference, prompt, ids, 0.8), atol=2e-3, rtol=0
            )
    assert_same(served_greedy(server.url), local_greedy(reference))
    assert httpx.post(server.url + "/reset_prefix_cache").json() == {"success": True}
    assert_same(served_greedy(server.url), local_greedy(reference))


def reference_logprobs(policy, prompt, completion, temperature) -> torch.Tensor:
    """log_softmax(logits / temperature) of each completion token, by a transformers forward."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = policy(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logps = torch.log_softmax(logits / temperature, dim=-1)
    return logps.gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def test_a_safetensors_update_over_http_makes_it_generate_as_the_updated_model(server):
    before = served_greedy(server.url)
    updated = model(7)
    response = update_over_http(server.url, dict(updated.named_parameters()))
    assert response.status_code == 200, response.text
    got = served_greedy(server.url)
    assert_same(got, local_greedy(updated))
    assert_changed(got, before)


def test_an_update_sent_tensor_by_tensor_is_loaded_at_finish(server):
    """vLLM fuses q, k and v: the server must not load a layer from one of its tensors."""
    before = served_greedy(server.url)
    updated = model(9)
    assert httpx.post(server.url + "/start_weight_update", timeout=30).status_code == 200
    for name, tensor in updated.named_parameters():
        response = update_over_http(server.url, {name: tensor})
        assert response.status_code == 200, response.text
    finish = httpx.post(server.url + "/finish_weight_update", json={"weight_version": 3}, timeout=120)
    assert finish.json()["weight_version"] == "3"
    got = served_greedy(server.url)
    assert_same(got, local_greedy(updated))
    assert_changed(got, before)


def test_a_bad_update_is_refused_with_400_and_changes_nothing(server, remote):
    before = served_greedy(server.url)
    weights = dict(model(11).named_parameters())
    unknown = update_over_http(server.url, {**weights, "model.no_such.weight": torch.ones(3)})
    assert unknown.status_code == 400 and "no parameter named 'model.no_such.weight'" in unknown.text
    wrong_shape = update_over_http(server.url, {**weights, "model.norm.weight": torch.ones(3)})
    assert wrong_shape.status_code == 400 and "model.norm.weight has shape (3,)" in wrong_shape.text
    with pytest.raises(WeightSyncError, match=r"refused it|HTTP 400"):
        remote.update_weights({**weights, "model.norm.weight": torch.ones(3)}.items(), version=9)
    with pytest.raises(WeightSyncError, match=r"HTTP 400.*no parameter named 'model\.no_such\.weight'"):
        remote.update_weights({**weights, "model.no_such.weight": torch.ones(3)}.items(), version=9)
    assert served_greedy(server.url) == before


def test_a_collective_update_from_remote_engine_makes_it_generate_as_the_updated_model(server, remote):
    assert remote.weight_transfer == "collective"
    before = served_greedy(server.url)
    updated = model(13)
    remote.update_weights(updated.named_parameters(), version=4)
    got = served_greedy(server.url)
    assert_same(got, local_greedy(updated))
    assert_changed(got, before)
    assert httpx.get(server.url + "/weight_info").json() == {"weight_version": "4"}
    assert remote.generate(PROMPTS[:1], GREEDY)[0][0].policy_version == 4


def test_the_trainer_runs_two_steps_against_it(server, vllm_model_dir, tmp_path):
    from grpoflow.run.build import build_trainer, run

    config = support.recipe(
        tmp_path,
        model=str(vllm_model_dir),
        max_steps=2,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server.url,
    )
    trainer = build_trainer(config)
    try:
        assert trainer.engine.weight_transfer == "collective"
        history = run(config, trainer)
    finally:
        trainer.engine.close()
    assert len(history) == 2
    assert all(step["completions/mean_length"] > 0 for step in history)
    # The post-sync check compared the server's log-probs with the trainer's trained weights.
    assert all(0 <= step["sync/check_logprob_gap"] < 1e-2 for step in history)
    assert server.service.weight_version == "2"
    trainer.model.eval()
    assert_same(served_greedy(server.url), local_greedy(trainer.model))


def test_a_model_without_a_checkpoint_is_written_for_vllm_and_kept_on_meta():
    config = ServeConfig(model="tiny", engine="vllm", device="cpu")
    source = vllm_backend.prepare(config, build_char_tokenizer())
    try:
        assert source.temporary and (source.directory / "config.json").is_file()
        assert any(source.directory.glob("*.safetensors"))
        assert all(p.device.type == "meta" for p in source.module.parameters())
        assert "lm_head.weight" in dict(source.module.named_parameters(remove_duplicate=False))
    finally:
        shutil.rmtree(source.directory)


def test_a_device_vllm_does_not_run_on_is_refused():
    with pytest.raises(ValueError, match="--device cuda: this vLLM build runs on cpu"):
        vllm_backend.vllm_device("cuda")
