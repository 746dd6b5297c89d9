"""Choosing the vLLM engines from the config, and the helpers that need no vLLM installed."""

from __future__ import annotations

from grpoflow.engines import ENGINES, SamplingParams
from grpoflow.engines.vllm import sampling_fields, truncates_distribution
from grpoflow.options.loader import load_config
from grpoflow.run.build import choose_engine


def config(**overrides):
    return load_config(None, {"model": "tiny", "dataset": "echo", "reward_funcs": ["echo"], **overrides})


def test_use_vllm_picks_the_colocated_or_server_engine():
    assert choose_engine(config(use_vllm=True)) == "vllm"
    assert choose_engine(config(use_vllm=True, vllm_mode="server")) == "vllm_server"
    assert choose_engine(config(rollout_engine="hf")) == "hf"
    assert {"vllm", "vllm_server"} <= set(ENGINES)


def test_sampling_fields_ask_for_the_sampled_token_logprob():
    params = SamplingParams(n=4, max_tokens=9, temperature=0.5, top_k=0, stop_token_ids=(1,), seed=3)
    fields = sampling_fields(params)
    assert fields["logprobs"] == 0 and fields["top_k"] == -1 and fields["stop_token_ids"] == [1]
    assert (fields["n"], fields["max_tokens"], fields["temperature"], fields["seed"]) == (4, 9, 0.5, 3)
    assert not truncates_distribution(params)
    assert truncates_distribution(SamplingParams(top_p=0.9))
