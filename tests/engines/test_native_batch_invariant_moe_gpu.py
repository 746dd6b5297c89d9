"""On a GPU: a random Qwen3-MoE policy in bfloat16 (8 layers of 64 experts, 8 a token, one layer
dense), the native engine's batch-invariant forward (paged cache, CUDA graphs, the grouped expert
kernel) and the trainer's replay on the training forward with the kernels installed. 64 prompts
x 4 samples x 64 tokens: the replay agrees with every draw in one round, and prompts served from
the prefix cache give the same completions bit for bit, each token scored by the engine as the
trainer scores it.

    pytest -m gpu tests/engines/test_native_batch_invariant_moe_gpu.py
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
from grpoflow.policy.placement import Placement
from grpoflow.policy.tiny import build_tiny_model
from grpoflow.rollout.on_policy import OnPolicyDraws, Replay

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB_SIZE = 151936
PROMPTS, SAMPLES, TOKENS = 64, 4, 64
SHAPE = dict(
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


def test_the_replay_agrees_with_every_draw_of_a_moe_policy_in_one_round_gpu():
    policy = build_tiny_model(VOCAB_SIZE, dtype=torch.bfloat16, device="cuda", **SHAPE).eval()
    BatchInvariantKernels.install(policy)
    config = NativeEngineConfig(max_num_seqs=256, batch_invariant=True, gpu_memory_utilization=0.5)
    engine = NativeEngine(policy, config=config)
    assert engine.runner.use_graphs and engine.runner.ops.name == "batch_invariant"
    sparse = list(engine.family.sparse.values())
    assert len(sparse) == 7 and all(isinstance(mlp, InvariantSparseMlp) and mlp.grouped for mlp in sparse)
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
        assert [c.logprobs for c in ours] == [c.logprobs for c in theirs]


@pytest.fixture(autouse=True)
def free_gpu_memory():
    """The engine reserves half the GPU: give it back."""
    yield
    gc.collect()
    torch.cuda.empty_cache()
