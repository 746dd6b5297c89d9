"""On a GPU: a random Qwen2-0.5B-shaped model in bfloat16 (as it is, in the Qwen3 layout with
per-head q/k norms, or with LoRA adapters on every linear layer) or a random Qwen3-MoE (8 layers
of 64 experts, 8 a token, one layer dense: the grouped expert kernel), the native engine's
batch-invariant forward (paged cache, CUDA graphs) and the trainer's replay on the training
forward with the kernels installed. 64 prompts x 4 samples x 64 tokens: the replay agrees with
every draw in one round, and prompts served from the prefix cache give the same completions bit
for bit, each token scored by the engine as the trainer scores it.

    pytest -m gpu tests/engines/test_native_batch_invariant_gpu.py
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from grpoflow.engines import SamplingParams, prefix_cache_metrics
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.models.batch_invariant import InvariantSparseMlp
from grpoflow.policy.batch_invariant import BatchInvariantKernels
from grpoflow.policy.lora import generation_model
from grpoflow.policy.placement import Placement
from grpoflow.policy.tiny import build_preset_model, build_tiny_model
from grpoflow.rollout.on_policy import OnPolicyDraws, Replay

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB_SIZE = 151936
PROMPTS, SAMPLES, TOKENS = 64, 4, 64
MOE_SHAPE = dict(
    model_type="qwen3_moe",
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=2048,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    norm_topk_prob=True,
    mlp_only_layers=[3],
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


class Tokens:
    """A tokenizer of ids (nothing here stops on text)."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def prompts_and_params() -> tuple[list[list[int]], list[SamplingParams]]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 129, (PROMPTS,), generator=generator).tolist()
    prompts = [torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist() for length in lengths]
    params = [
        SamplingParams(n=SAMPLES, max_tokens=TOKENS, temperature=1.0, seed=1000 + index, ignore_eos=True)
        for index in range(PROMPTS)
    ]
    return prompts, params


def policy_of(case: str) -> torch.nn.Module:
    """`qwen2`: the preset; `qwen3`: its shape in the Qwen3 layout (head_dim 128, q/k norms);
    `lora`: the preset with grpoflow's LoRA adapters (float32, multiplied in bfloat16) on every
    linear layer, every B drawn nonzero; `moe`: MOE_SHAPE."""
    if case == "moe":
        return build_tiny_model(VOCAB_SIZE, dtype=torch.bfloat16, device="cuda", **MOE_SHAPE).eval()
    shape = {"model_type": "qwen3", "head_dim": 128} if case == "qwen3" else {}
    model = build_preset_model("qwen2-0.5b", VOCAB_SIZE, dtype=torch.bfloat16, device="cuda", **shape)
    if case != "lora":
        return model.eval()
    from grpoflow.policy.lora import AdapterConfig, add_lora

    adapters = AdapterConfig(train_type="lora", lora_rank=16, lora_alpha=24, lora_dropout=0.0)
    policy = add_lora(model, adapters)
    generator = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, device="cuda") * 0.02)
    return policy.eval()


@pytest.mark.parametrize("case", ["qwen2", "qwen3", "lora", "moe"])
def test_the_replay_agrees_with_every_draw_in_one_round_gpu(case):
    policy = policy_of(case)
    BatchInvariantKernels.install(policy)
    config = NativeEngineConfig(max_num_seqs=256, batch_invariant=True, gpu_memory_utilization=0.5)
    engine = NativeEngine(generation_model(policy), config=config)
    assert engine.runner.use_graphs and engine.runner.ops.name == "batch_invariant"
    assert engine.family.has_qk_norm == (case in ("qwen3", "moe"))
    sparse = list(engine.family.sparse.values())
    assert all(isinstance(mlp, InvariantSparseMlp) and mlp.grouped for mlp in sparse)
    assert len(sparse) == (7 if case == "moe" else 0)
    assert any(adapters.o.terms for adapters in engine.family.adapters) == (case == "lora")
    prompts, params = prompts_and_params()
    draws = OnPolicyDraws(Tokens(), Replay(Placement(module=policy, device=torch.device("cuda")), 32, 1.0))
    completions = draws.generate(engine, prompts, params)
    metrics = draws.metrics()
    assert sum(len(c.token_ids) for group in completions for c in group) == PROMPTS * SAMPLES * TOKENS
    assert metrics["on_policy/rounds"] == 1, metrics
    assert metrics["on_policy/replaced_tokens"] == 0 and metrics["on_policy/unchecked_tokens"] == 0
    again = engine.generate(prompts, [dataclasses.replace(one, draw="gumbel") for one in params])
    assert prefix_cache_metrics(engine.stats.prefill)["rollout/prefix_cache_hit_tokens"] > 0
    for ours, theirs in zip(completions, again):
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
        # the engine's own scores are the trainer's (on_policy_check: update rests on it)
        assert [c.logprobs for c in ours] == [c.logprobs for c in theirs]


@pytest.fixture(autouse=True)
def free_gpu_memory():
    """Each case's engine reserves half the GPU: the next case needs it back."""
    yield
    gc.collect()
    torch.cuda.empty_cache()
