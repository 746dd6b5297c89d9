"""Choosing the vLLM engines from the config, and the helpers that need no vLLM installed."""

from __future__ import annotations

import torch

from grpoflow.engines import ENGINES, SamplingParams
from grpoflow.engines.vllm import layer_groups, sampling_fields, truncates_distribution, weight_buckets
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
    assert not truncates_distribution(params)
    assert truncates_distribution(SamplingParams(top_p=0.9))


def test_weight_buckets_are_bounded():
    weights = [(f"w{i}", torch.zeros(256)) for i in range(10)]  # 1 KiB each
    buckets = list(weight_buckets(weights, max_bytes=3 * 1024))
    assert [len(bucket) for bucket in buckets] == [3, 3, 3, 1]
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in weights]


def test_layer_groups_hold_whole_layers_and_are_taken_from_the_stream_one_at_a_time():
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i}.{part}.weight" for i in range(4) for part in ("q_proj", "k_proj", "mlp")]
    names += ["model.norm.weight", "lm_head.weight"]
    consumed = []

    def stream():
        for name in names:
            consumed.append(name)
            yield name, torch.zeros(2)

    groups = layer_groups(stream(), num_groups=3, num_layers=4)
    first = next(groups)
    assert len(consumed) == 1 + 2 * 3 + 1  # the group, and the tensor that opened the next
    rest = list(groups)
    layers = [
        sorted({name.split(".")[2] for name, _ in group if ".layers." in name}) for group in [first, *rest]
    ]
    assert layers == [["0", "1"], ["2"], ["3"]]
    assert first[0][0] == "model.embed_tokens.weight" and rest[-1][-1][0] == "lm_head.weight"
    assert [name for group in [first, *rest] for name, _ in group] == names
    assert len(list(layer_groups(((n, torch.zeros(1)) for n in names), num_groups=9, num_layers=4))) == 4
    assert len(list(layer_groups(((n, torch.zeros(1)) for n in names), num_groups=1, num_layers=4))) == 1
