"""The native engine generating a LoRA policy with its adapters unmerged: the same rollouts as the
merged model (token ids and log-probs, greedy and seeded sampling), on every model path, with the
base weights never written."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers.native_fixtures import forward_logprobs, one_thread, tiny  # noqa: F401 (a fixture)

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig

pytest.importorskip("peft")

from grpoflow.policy.lora import AdapterConfig, add_lora, generation_model, merged_weights  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(2, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, n=2, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, n=3, ignore_eos=True, seed=3)


def engine(model, **kwargs) -> NativeEngine:
    config = dict(max_num_seqs=8, block_size=4, num_kv_blocks=256, **kwargs)
    return NativeEngine(model, config=NativeEngineConfig(**config))


def adapted(model_type: str, *, targets=("all-linear",), tied: bool = True, seed: int = 0):
    """A tiny PeftModel with non-zero adapters (dropout on: generation must not apply it), and the
    plain model with those adapters merged into its weights."""
    base = tiny(model_type, tie_word_embeddings=tied, seed=seed)
    plain = copy.deepcopy(base)
    policy = add_lora(base, AdapterConfig(lora_rank=4, lora_dropout=0.5, target_modules=list(targets)))
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3)
    plain.load_state_dict(dict(merged_weights(policy)), strict=False)
    return policy.train(), plain.eval()


def assert_same_rollouts(got, want) -> None:
    for got_prompt, want_prompt in zip(got, want, strict=True):
        for got_one, want_one in zip(got_prompt, want_prompt, strict=True):
            assert got_one.token_ids == want_one.token_ids
            np.testing.assert_allclose(got_one.logprobs, want_one.logprobs, rtol=0, atol=1e-4)


def base_weights(policy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy.named_parameters() if "lora_" not in name}


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama", "mistral"])
@pytest.mark.parametrize("fuse", [True, False])
def test_unmerged_adapters_roll_out_as_the_merged_model(model_type, fuse):
    policy, plain = adapted(model_type)
    before = base_weights(policy)
    native = engine(generation_model(policy), fuse_projections=fuse)
    assert native.path == "family" and native.capabilities.applies_adapters
    reference = engine(plain, fuse_projections=fuse)
    for params in (GREEDY, SAMPLED):
        assert_same_rollouts(native.generate(PROMPTS, params), reference.generate(PROMPTS, params))
    after = base_weights(policy)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert policy.training  # the engine's eval mode, if any, is undone


@pytest.mark.parametrize(
    ("targets", "tied"),
    [(["q_proj", "v_proj", "up_proj"], True), (["k_proj", "down_proj", "lm_head"], False)],
)
def test_some_projections_adapted_and_an_adapted_output_head(targets, tied):
    policy, plain = adapted("qwen2", targets=targets, tied=tied)
    native = engine(generation_model(policy))
    for params in (GREEDY, SAMPLED):
        assert_same_rollouts(native.generate(PROMPTS, params), engine(plain).generate(PROMPTS, params))


def test_generic_path_applies_the_adapters_without_dropout():
    policy, plain = adapted("qwen2")
    native = engine(generation_model(policy), force_generic=True)
    assert native.path == "generic"
    for params in (GREEDY, SAMPLED):
        got = native.generate(PROMPTS, params)
        want = engine(plain, force_generic=True).generate(PROMPTS, params)
        assert_same_rollouts(got, want)
    assert policy.training


def test_an_adapter_update_in_place_reaches_the_next_rollout():
    """An optimizer step writes the adapters in place: cached prefixes are dropped, and the
    captured adapters (fused A views included) are the live ones."""
    policy, _ = adapted("llama")
    native = engine(generation_model(policy))
    native.generate(PROMPTS, GREEDY)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                parameter.mul_(-1.5)
    _, plain = adapted("llama")
    plain.load_state_dict(dict(merged_weights(policy)), strict=False)
    for params in (GREEDY, SAMPLED):
        assert_same_rollouts(native.generate(PROMPTS, params), engine(plain).generate(PROMPTS, params))


def test_merged_or_disabled_adapters_are_not_added_twice():
    policy, plain = adapted("qwen3")
    native = engine(generation_model(policy))
    want = engine(plain).generate(PROMPTS, GREEDY)
    policy.merge_adapter()
    assert_same_rollouts(native.generate(PROMPTS, GREEDY), want)
    policy.unmerge_adapter()
    with policy.disable_adapter():
        base_rollout = native.generate(PROMPTS, GREEDY)
    base = tiny("qwen3")
    assert_same_rollouts(base_rollout, engine(base).generate(PROMPTS, GREEDY))
    assert_same_rollouts(native.generate(PROMPTS, GREEDY), want)


def test_adapters_the_engine_cannot_apply_go_to_the_generic_path():
    from peft import LoraConfig, get_peft_model

    base = tiny("qwen2")
    policy = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    native = engine(generation_model(policy))
    assert native.path == "generic"
    assert len(native.generate(PROMPTS, GREEDY)[0][0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_float32_adapters_on_a_bfloat16_base_follow_the_trainer(device):
    """PEFT keeps adapters in float32 on a bfloat16 base; the trainer multiplies them in bfloat16
    (`lora_precision`) and so does the engine, through bfloat16 copies written before each
    rollout, so its log-probs follow the trainer's, also after an in-place optimizer step (on CUDA:
    through the decode step's captured graphs), within the rounding the bfloat16 base alone shows
    here (0.05)."""
    base = tiny("qwen2", dtype=torch.bfloat16, device=device)
    policy = add_lora(base, AdapterConfig(lora_rank=4, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                assert parameter.dtype == torch.float32
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    native = engine(generation_model(policy))
    for _ in range(2):
        outputs = native.generate(PROMPTS, SAMPLED)
        terms = [term for layer in native.family.adapters for term in layer.o.terms]
        assert terms and all(c.dtype == torch.bfloat16 for term in terms for c in term.copies)
        assert all(torch.equal(term.copies[1], term.up.weight.bfloat16()) for term in terms)
        for prompt, completions in zip(PROMPTS, outputs):
            for completion in completions:
                expected = forward_logprobs(policy.eval(), prompt, completion.token_ids, SAMPLED.temperature)
                np.testing.assert_allclose(completion.logprobs, expected, atol=0.08)
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                if "lora_B" in name:
                    parameter.neg_()  # in place, as an optimizer step writes


def test_a_fused_optimizer_step_reaches_the_next_rollouts_adapter_copies():
    """A fused AdamW step writes the float32 adapters without moving their version counters; the
    sync's `update_weights` marks the values new, so the next rollout's bfloat16 copies are the
    stepped adapters."""
    policy = add_lora(tiny("qwen2", dtype=torch.bfloat16), AdapterConfig(lora_rank=4, lora_dropout=0.0))
    model = generation_model(policy)
    native = engine(model)
    native.generate(PROMPTS, GREEDY)
    adapters = [parameter for name, parameter in policy.named_parameters() if "lora_" in name]
    for parameter in adapters:
        parameter.grad = torch.ones_like(parameter)
    torch.optim.AdamW(adapters, lr=0.01, fused=True).step()
    native.update_weights(model.named_parameters(), version=1)
    native.generate(PROMPTS, GREEDY)
    terms = [term for layer in native.family.adapters for term in layer.o.terms]
    assert terms and all(torch.equal(term.copies[1], term.up.weight.bfloat16()) for term in terms)
