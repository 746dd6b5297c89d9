"""Gemma 3 (text) on the native engine's family path, on the CPU: the family forward is the one
that runs, greedy tokens and sampled log-probs against transformers with prompts longer than the
sliding window, the prefix cache, LoRA adapters, and the generic path's one line for the variants
the family path does not read."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
from helpers.native_fixtures import (
    GEMMA3_WINDOW,
    forward_logprobs,
    hf_greedy,
    one_thread,  # noqa: F401 (a fixture)
    tiny_gemma3,
)

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.models.gemma import GemmaModel

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(2, 30))]
GENERIC_LINE = "runs on the native engine's generic path"


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3()


def engine(model, **kwargs) -> NativeEngine:
    config = dict(max_num_seqs=8, block_size=4, num_kv_blocks=256)
    config.update(kwargs)
    return NativeEngine(model, config=NativeEngineConfig(**config))


def greedy(max_tokens: int = 24, n: int = 2) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True)


def test_the_family_forward_runs_it_with_a_window_that_matters(model):
    native = engine(model)
    assert native.path == "family" and isinstance(native.family, GemmaModel)
    assert native.family.windows == [GEMMA3_WINDOW, 0, GEMMA3_WINDOW]
    assert native.family.rotary_of == [1, 0, 1] and len(native.family.rotary) == 2
    unwindowed = copy.deepcopy(model)
    unwindowed.config.sliding_window = 1000
    assert hf_greedy(unwindowed, PROMPTS[2], 12) != hf_greedy(model, PROMPTS[2], 12)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "apart"])
def test_greedy_tokens_match_transformers(model, fuse):
    outputs = engine(model, fuse_projections=fuse).generate(PROMPTS, greedy())
    for prompt, completions in zip(PROMPTS, outputs):
        reference = hf_greedy(model, prompt, 24)
        assert [completion.token_ids for completion in completions] == [reference, reference]


def test_logprobs_match_a_forward_pass(model):
    params = SamplingParams(temperature=0.7, max_tokens=16, n=2, ignore_eos=True, seed=1)
    for prompt, completions in zip(PROMPTS, engine(model).generate(PROMPTS, params)):
        for completion in completions:
            expected = forward_logprobs(model, prompt, completion.token_ids, 0.7)
            np.testing.assert_allclose(completion.logprobs, expected, atol=1e-4)


def test_the_prefix_cache_serves_blocks_past_the_window(model):
    """The cached prefix is far longer than the window: its blocks are shared, and the sliding
    layers mask what lies outside the window of each new token."""
    shared = list(range(2, 30))
    prompts = [shared + [40, 41], shared + [42]]
    cached = engine(model)
    cached.generate([shared], greedy(2, n=1))  # its blocks are cached
    outputs = cached.generate(prompts, greedy(8))
    assert cached.stats.prefill.num_cached_tokens >= 2 * 24
    for prompt, completions in zip(prompts, outputs):
        reference = hf_greedy(model, prompt, 8)
        assert [completion.token_ids for completion in completions] == [reference, reference]


def test_adapters_stay_on_the_family_path():
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(tiny_gemma3(), peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3)
    native = engine(adapted.get_base_model())
    assert native.path == "family"
    outputs = native.generate(PROMPTS, greedy(12))
    merged = adapted.merge_and_unload().eval()
    for prompt, completions in zip(PROMPTS, outputs):
        assert completions[0].token_ids == hf_greedy(merged, prompt, 12)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (dict(attn_logit_softcapping=2.0), "attn_logit_softcapping is set"),
        (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    ],
    ids=["attention_softcap", "activation"],
)
def test_an_unsupported_variant_runs_generic_with_one_line(caplog, overrides, reason):
    model = tiny_gemma3(**overrides)
    with caplog.at_level(logging.INFO, logger="grpoflow.engines.native"):
        native = engine(model)
        outputs = native.generate(PROMPTS[2:], greedy(6, n=1))
    lines = [record.getMessage() for record in caplog.records if GENERIC_LINE in record.getMessage()]
    assert native.path == "generic" and len(lines) == 1
    assert lines[0].startswith("gemma3_text runs on") and f"the reason here: {reason}" in lines[0]
    assert outputs[0][0].token_ids == hf_greedy(model, PROMPTS[2], 6)
