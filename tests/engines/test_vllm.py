"""The colocated vLLM engine on the CPU, checked against a transformers forward pass."""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from helpers import support  # noqa: E402
from helpers.vllm_reference import PROMPTS, greedy, perturbed, reference_logprobs  # noqa: E402

from grpoflow.engines import EngineConfig, EngineOptions, SamplingParams, build_engine  # noqa: E402
from grpoflow.engines.vllm import (
    VLLMConfig,  # noqa: E402
    VLLMEngine,  # noqa: E402
)
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402

TINY_SHAPE = support.VLLM_TINY_SHAPE


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_char_tokenizer()
    return build_tiny_model(len(tokenizer), **TINY_SHAPE).eval(), tokenizer


@pytest.fixture(scope="module")
def engine(policy):
    model, tokenizer = policy
    options = EngineOptions(engine=EngineConfig(max_model_len=128), vllm=VLLMConfig(vllm_enforce_eager=True))
    engine = build_engine("vllm", model, tokenizer, options)
    yield engine
    engine.close()


def test_generate_returns_n_completions_with_transformers_logprobs(engine, policy):
    model, _ = policy
    params = SamplingParams(n=3, max_tokens=8, temperature=0.7, seed=3)
    groups = engine.generate(PROMPTS, params)
    assert isinstance(engine, VLLMEngine)
    assert [len(group) for group in groups] == [3, 3, 3]
    assert engine.stats.num_generated_tokens == sum(len(c.token_ids) for g in groups for c in g)
    for prompt, group in zip(PROMPTS, groups):
        assert len({tuple(c.token_ids) for c in group}) > 1  # n samples, not one repeated
        for completion in group:
            assert completion.finish_reason == "length" and len(completion.token_ids) == 8
            want = reference_logprobs(model, prompt, completion.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(completion.logprobs), want, atol=2e-3, rtol=0)


def test_a_stop_token_ends_the_completion_with_reason_stop(engine):
    first = greedy(engine, max_tokens=8)[0]
    stop = first.token_ids[2]
    stopped = engine.generate(
        PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop])
    )
    completion = stopped[0][0]
    end = first.token_ids.index(stop) + 1
    assert completion.token_ids == first.token_ids[:end]
    assert completion.finish_reason == "stop" and len(completion.logprobs) == end


def test_update_weights_changes_outputs_and_restores_them(engine, policy):
    model, _ = policy
    before = greedy(engine)
    weights = perturbed(model)
    engine.update_weights(weights, version=7)
    after = greedy(engine)
    assert engine.policy_version == 7 and after[0].policy_version == 7
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    changed = copy.deepcopy(model)
    changed.load_state_dict(dict(weights), strict=False)  # the tied LM head follows the embedding
    for prompt, completion in zip(PROMPTS, after):
        want = reference_logprobs(changed, prompt, completion.token_ids, 0.0)
        torch.testing.assert_close(torch.tensor(completion.logprobs), want, atol=2e-3, rtol=0)
    engine.update_weights(model.named_parameters(), version=8)
    restored = greedy(engine)
    assert [c.token_ids for c in restored] == [c.token_ids for c in before]
    torch.testing.assert_close(restored[0].logprobs, before[0].logprobs, atol=1e-5, rtol=0)


def test_move_model_batches_pushes_whole_layers_in_that_many_loads_with_the_same_result(
    engine, policy, monkeypatch
):
    model, _ = policy
    weights = perturbed(model)
    engine.update_weights(weights, version=1)
    single = greedy(engine)
    engine.update_weights(model.named_parameters(), version=2)
    loads = []
    rpc = engine.llm.collective_rpc

    def recording_rpc(method, *args, kwargs=None, **rest):
        if method == "grpoflow_reload_weights" and kwargs.get("weights_iterator") is not None:
            pairs = list(kwargs["weights_iterator"])
            loads.append([name for name, _ in pairs])
            kwargs = {**kwargs, "weights_iterator": iter(pairs)}
        return rpc(method, *args, kwargs=kwargs, **rest)

    monkeypatch.setattr(engine.llm, "collective_rpc", recording_rpc)
    monkeypatch.setattr(engine, "move_model_batches", 2)
    engine.update_weights(iter(weights), version=3)  # a stream, taken one group at a time
    assert len(loads) == 2  # the tiny model's 2 decoder layers, one per load
    assert [name for load in loads for name in load] == [name for name, _ in weights]
    assert all(".layers.1." not in name for name in loads[0])
    assert all(".layers.0." not in name for name in loads[1])
    grouped = greedy(engine)
    assert [c.token_ids for c in grouped] == [c.token_ids for c in single]
    assert [c.logprobs for c in grouped] == [c.logprobs for c in single]
    engine.update_weights(model.named_parameters(), version=4)


def test_sleep_without_platform_support_warns_once_and_keeps_generating(engine, monkeypatch):
    monkeypatch.setattr(engine, "sleep_level", 1)
    monkeypatch.setattr(engine, "_warned", set())
    before = greedy(engine)
    with pytest.warns(UserWarning, match="no sleep mode"):
        engine.sleep()
    engine.sleep()  # warned once only (pytest would flag a second warning below as an error)
    engine.wake_up()
    assert [c.token_ids for c in greedy(engine)] == [c.token_ids for c in before]


def test_wake_up_after_level_2_pushes_the_trained_weights(engine, policy, monkeypatch):
    """Where vLLM can sleep, level 2 discards its weights: wake_up must push the latest trained
    ones. The CPU has no sleep mode, so a fake sleep scrambles vLLM's weights instead."""
    model, _ = policy
    scramble = perturbed(model, scale=3.0, seed=9)

    def fake_sleep(level):
        engine.llm.collective_rpc("grpoflow_reload_weights", kwargs={"weights_iterator": iter(scramble)})

    monkeypatch.setattr(engine, "sleep_supported", True)
    monkeypatch.setattr(engine, "sleep_level", 2)
    monkeypatch.setattr(engine.llm, "sleep", fake_sleep)
    monkeypatch.setattr(engine.llm, "wake_up", lambda: True)
    trained = perturbed(model)
    engine.update_weights(trained, version=1)
    expected = greedy(engine)
    engine.sleep()
    engine.wake_up()  # nothing new was pushed while asleep: the last pushed weights come back
    assert [c.logprobs for c in greedy(engine)] == [c.logprobs for c in expected]
    engine.sleep()
    engine.update_weights(model.named_parameters(), version=2)  # held until wake_up
    engine.wake_up()
    monkeypatch.undo()
    original = greedy(engine)
    for completion in original:
        prompt = PROMPTS[original.index(completion)]
        want = reference_logprobs(model, prompt, completion.token_ids, 0.0)
        torch.testing.assert_close(torch.tensor(completion.logprobs), want, atol=2e-3, rtol=0)


@pytest.mark.slow
def test_trainer_runs_with_colocated_vllm_and_syncs_its_weights(tmp_path):
    from grpoflow.run.build import build_trainer

    tokenizer = build_char_tokenizer()
    model_dir = tmp_path / "model"
    build_tiny_model(len(tokenizer), **TINY_SHAPE).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    config = support.recipe(
        tmp_path, model=str(model_dir), use_vllm=True, vllm_enforce_eager=True, max_steps=2
    )
    trainer = build_trainer(config)
    try:
        assert isinstance(trainer.engine, VLLMEngine)
        assert trainer.engine.model_dir == model_dir  # the policy's own checkpoint, no copy
        before = greedy(trainer.engine)
        history = trainer.train()
        assert len(history) == 2 and all(torch.isfinite(torch.tensor(step["loss"])) for step in history)
        assert trainer.engine.policy_version == 2
        after = greedy(trainer.engine)
        assert [c.logprobs for c in after] != [c.logprobs for c in before]
        trainer.model.eval()
        for prompt, completion in zip(PROMPTS, after):  # vLLM now runs the trained weights
            want = reference_logprobs(trainer.model, prompt, completion.token_ids, 0.0)
            torch.testing.assert_close(torch.tensor(completion.logprobs), want, atol=2e-3, rtol=0)
    finally:
        trainer.engine.close()
