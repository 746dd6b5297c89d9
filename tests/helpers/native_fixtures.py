"""Helpers shared by the native-engine tests: tiny models and transformers' greedy reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from grpoflow.policy.tiny import PRESETS, build_tiny_model

VOCAB_SIZE = 52
FAMILIES = ("qwen2", "llama", "qwen3", "mistral")


def tiny(model_type: str = "qwen2", device: str = "cpu", dtype=torch.float32, **kwargs):
    """A tiny random model in eval mode (float32 unless told)."""
    model = build_tiny_model(VOCAB_SIZE, model_type=model_type, dtype=dtype, **kwargs)
    return model.to(device).eval()


def tiny_moe(norm_topk_prob: bool = True, seed: int = 0, device: str = "cpu", dtype=torch.float32):
    """A tiny random Qwen3-MoE model in eval mode: 4 layers, the second dense (mlp_only_layers), 8
    experts, top 2; routers scaled up so that the top two experts stand clear of the rest."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=[1],
        max_position_embeddings=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.mul_(10)
    return model.to(device=device, dtype=dtype).eval()


EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def expert_lora(model, rank: int = 4, std: float = 0.3, seed: int = 3):
    """`model` (a MoE model) as a PeftModel in eval mode with LoRA on q_proj and on its fused
    experts (`target_parameters`), every B drawn at `std` (PEFT starts them at zero) so that the
    adapters change the output."""
    import peft

    config = peft.LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=["q_proj"],
        target_parameters=EXPERT_PARAMETERS,
    )
    policy = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                noise = torch.randn(parameter.shape, generator=generator) * std
                parameter.copy_(noise.to(parameter.device, parameter.dtype))
    return policy.eval()


GEMMA3_WINDOW = 5
"""The sliding window of `tiny_gemma3`'s sliding layers, shorter than the tests' sequences."""


def tiny_gemma3(seed: int = 0, device: str = "cpu", dtype=torch.float32, **overrides):
    """A tiny random Gemma 3 text model in eval mode: three layers (sliding, full, sliding), a
    window of GEMMA3_WINDOW tokens, rotary tables of their own (linear scaling on the full
    layers), final logit soft-capping, and norm weights drawn away from zero (so `1 + weight`
    differs from weight and from 1)."""
    shape = {
        **PRESETS["tiny-gemma3"],
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": GEMMA3_WINDOW,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000.0},
        },
        "final_logit_softcapping": 3.0,
        **overrides,
    }
    model = build_tiny_model(VOCAB_SIZE, seed=seed, **shape)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model.to(device=device, dtype=dtype).eval()


def perturbed(model, scale: float):
    """A copy of `model` whose every parameter moved by `scale` of its own spread (a fixed draw):
    another model that proposes tokens near the policy's."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return other


def hf_greedy(model, prompt: list[int], num_tokens: int, repetition_penalty: float = 1.0) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt, with no stop token."""
    device = next(model.parameters()).device
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []  # None falls back to the model config's EOS
    config.max_new_tokens, config.do_sample, config.pad_token_id = num_tokens, False, 0
    config.repetition_penalty = repetition_penalty
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            generation_config=config,
        )
    return output[0, len(prompt) :].tolist()


def forward_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each completion token from one forward over the whole sequence."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + completion], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = (logits / temperature).log_softmax(-1)
    return logprobs.gather(1, torch.tensor(completion, device=device)[:, None])[:, 0].tolist()


def chi_square_critical(degrees: int, z: float = 3.29) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z=3.29 is the 0.9995 normal quantile."""
    factor = 2.0 / (9.0 * degrees)
    return degrees * (1.0 - factor + z * math.sqrt(factor)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson statistic of `counts` against `probs`, pooling bins expected below `min_expected`.

    Returns (statistic, degrees of freedom).
    """
    total = counts.sum()
    expected = probs.double() * total
    big = expected >= min_expected
    observed_bins = torch.cat((counts[big].double(), counts[~big].double().sum()[None]))
    expected_bins = torch.cat((expected[big], expected[~big].sum()[None]))
    keep = expected_bins > 0
    statistic = ((observed_bins[keep] - expected_bins[keep]) ** 2 / expected_bins[keep]).sum().item()
    return statistic, int(keep.sum().item()) - 1


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The models are tiny: a second thread only adds contention on a busy machine (a module
    importing this fixture runs its tests on one torch thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
