"""Choosing the vLLM engines from the config, and the helpers that need no vLLM installed."""

from __future__ import annotations

from grpoflow.engines import ENGINES, SamplingParams
from grpoflow.engines.vllm import penalises_repetition, sampling_fields
from grpoflow.run.config import load_config


def config(**overrides):
    return load_config(None, {"model": "tiny", "dataset": "echo", "reward_funcs": ["echo"], **overrides})


def test_use_vllm_picks_the_colocated_or_server_engine():
    assert config(use_vllm=True).generation.engine_name == "vllm"
    assert config(use_vllm=True, vllm_mode="server").generation.engine_name == "vllm_server"
    assert config(rollout_engine="hf").generation.engine_name == "hf"
    assert config().generation.engine_name == "native"
    assert config(num_infer_workers=1).generation.engine_name == "vllm_server"
    assert {"vllm", "vllm_server"} <= set(ENGINES)


def test_sampling_fields_ask_for_the_sampled_token_logprob():
    params = SamplingParams(n=4, max_tokens=9, temperature=0.5, top_k=0, stop_token_ids=(1,), seed=3)
    fields = sampling_fields(params)
    assert fields["logprobs"] == 0 and fields["top_k"] == -1 and fields["stop_token_ids"] == [1]
    assert (fields["n"], fields["max_tokens"], fields["temperature"], fields["seed"]) == (4, 9, 0.5, 3)
    assert not penalises_repetition(params) and not penalises_repetition(SamplingParams(top_p=0.9))
    assert penalises_repetition(SamplingParams(repetition_penalty=1.1))
