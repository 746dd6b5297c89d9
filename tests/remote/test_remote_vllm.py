"""RemoteEngine against a real vLLM OpenAI-compatible server started on the CPU (the checkpoint
transport; grpoflow serve: test_remote.py)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("httpx")

from helpers import support  # noqa: E402
from helpers.vllm_reference import PROMPTS, greedy, perturbed, reference_logprobs  # noqa: E402

from grpoflow.engines import EngineConfig, EngineOptions, SamplingParams, build_engine  # noqa: E402
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpoflow.remote.engine import RemoteConfig, RemoteEngine  # noqa: E402
from grpoflow.transport import ServerError, WeightSyncError  # noqa: E402


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(len(tokenizer), **support.VLLM_TINY_SHAPE).eval()
    directory = tmp_path_factory.mktemp("model")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, directory


@pytest.fixture(scope="module")
def server(policy, tmp_path_factory):
    """A vLLM server in dev mode with grpoflow's worker extension; yields its URL."""
    _, directory = policy
    log_dir = tmp_path_factory.mktemp("server")
    with support.vllm_openai_server(directory, log_dir, "--max-model-len", "256") as url:
        yield url


@pytest.fixture(scope="module")
def engine(server):
    config = RemoteConfig(vllm_server_base_url=server, vllm_server_timeout=180)
    options = EngineOptions(engine=EngineConfig(max_model_len=256), remote=config)
    engine = build_engine("vllm_server", None, None, options)
    yield engine
    engine.close()


def test_generate_returns_n_completions_with_transformers_logprobs(engine, policy):
    model, _ = policy
    assert isinstance(engine, RemoteEngine) and engine.reload_methods == ["grpoflow_reload_weights"]
    groups = engine.generate(PROMPTS, SamplingParams(n=3, max_tokens=8, temperature=0.7, seed=5))
    assert [len(group) for group in groups] == [3, 3, 3]
    for prompt, group in zip(PROMPTS, groups):
        assert len({tuple(c.token_ids) for c in group}) > 1
        for completion in group:
            assert completion.finish_reason == "length" and len(completion.token_ids) == 8
            want = reference_logprobs(model, prompt, completion.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(completion.logprobs), want, atol=2e-3, rtol=0)


def test_prompts_split_across_servers_keep_their_order(engine, server):
    twice = RemoteEngine([server, server], startup_timeout=30)
    try:
        want = greedy(engine)
        got = greedy(twice)
        assert twice.stats.extra["num_servers_used"] == 2
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
    finally:
        twice.close()


def test_update_weights_reach_the_server(engine, policy):
    model, _ = policy
    before = greedy(engine)
    weights = perturbed(model)
    engine.update_weights(iter(weights), version=3)
    after = greedy(engine)
    assert engine.policy_version == 3 and after[0].policy_version == 3
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    changed = copy.deepcopy(model)
    changed.load_state_dict(dict(weights), strict=False)
    for prompt, completion in zip(PROMPTS, after):
        want = reference_logprobs(changed, prompt, completion.token_ids, 0.0)
        torch.testing.assert_close(torch.tensor(completion.logprobs), want, atol=2e-3, rtol=0)
    assert engine.client.request("GET", engine.urls[0], "/weight_info") == {"weight_version": "3"}
    engine.update_weights(model.named_parameters(), version=4)
    assert [c.token_ids for c in greedy(engine)] == [c.token_ids for c in before]
    assert sorted(path.name for path in engine.transport.directory.iterdir()) == [
        "policy-v4"
    ]  # old ones removed


def test_failures_name_the_server_and_step(engine, policy):
    with pytest.raises(ServerError, match=r"answered POST /v1/completions with HTTP 400"):
        engine.generate([[5] * 300], SamplingParams(max_tokens=4))  # longer than max_model_len
    model, _ = policy
    bad = [("model.layers.0.no_such.weight", torch.zeros(3))]
    with pytest.raises(
        WeightSyncError, match=r"on vLLM server http://127\.0\.0\.1:\d+ failed at step 'reload_weights'"
    ):
        engine.update_weights(bad, version=5)
    engine.update_weights(model.named_parameters(), version=6)  # the server recovers
    completion = greedy(engine)[0]
    want = reference_logprobs(model, PROMPTS[0], completion.token_ids, 0.0)
    torch.testing.assert_close(torch.tensor(completion.logprobs), want, atol=2e-3, rtol=0)


@pytest.mark.slow
def test_trainer_drives_the_server_and_syncs_its_weights(server, policy, tmp_path):
    from grpoflow.run.build import build_trainer

    _, directory = policy
    config = support.recipe(
        tmp_path,
        model=str(directory),
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server,
        max_steps=2,
    )
    trainer = build_trainer(config)
    try:
        assert isinstance(trainer.engine, RemoteEngine)
        history = trainer.train()
        assert len(history) == 2 and trainer.engine.policy_version == 2
        trainer.model.eval()
        for prompt, completion in zip(PROMPTS, greedy(trainer.engine)):  # the server runs the trained weights
            want = reference_logprobs(trainer.model, prompt, completion.token_ids, 0.0)
            torch.testing.assert_close(torch.tensor(completion.logprobs), want, atol=2e-3, rtol=0)
    finally:
        trainer.engine.close()
