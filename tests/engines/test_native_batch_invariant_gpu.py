"""On a GPU: a random Qwen2-0.5B-shaped model in bfloat16, the native engine's batch-invariant
forward (paged cache, CUDA graphs) and the trainer's replay on the training forward with the
kernels installed. 64 prompts x 4 samples x 64 tokens: the replay agrees with every draw in one
round, and prompts served from the prefix cache give the same completions bit for bit.

    pytest -m gpu tests/engines/test_native_batch_invariant_gpu.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpoflow.engines import SamplingParams, prefix_cache_metrics
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.policy.batch_invariant import BatchInvariantKernels
from grpoflow.policy.placement import Placement
from grpoflow.policy.tiny import build_preset_model
from grpoflow.rollout.on_policy import OnPolicyDraws, Replay

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB_SIZE = 151936
PROMPTS, SAMPLES, TOKENS = 64, 4, 64


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


def test_the_replay_agrees_with_every_draw_in_one_round_gpu():
    model = build_preset_model("qwen2-0.5b", VOCAB_SIZE, dtype=torch.bfloat16, device="cuda").eval()
    BatchInvariantKernels.install(model)
    config = NativeEngineConfig(max_num_seqs=256, batch_invariant=True, gpu_memory_utilization=0.5)
    engine = NativeEngine(model, config=config)
    assert engine.runner.use_graphs and engine.runner.ops.name == "batch_invariant"
    prompts, params = prompts_and_params()
    draws = OnPolicyDraws(Tokens(), Replay(Placement(module=model, device=torch.device("cuda")), 32, 1.0))
    completions = draws.generate(engine, prompts, params)
    metrics = draws.metrics()
    assert sum(len(c.token_ids) for group in completions for c in group) == PROMPTS * SAMPLES * TOKENS
    assert metrics["on_policy/rounds"] == 1, metrics
    assert metrics["on_policy/replaced_tokens"] == 0 and metrics["on_policy/unchecked_tokens"] == 0
    again = engine.generate(prompts, [dataclasses.replace(one, draw="gumbel") for one in params])
    assert prefix_cache_metrics(engine.stats.prefill)["rollout/prefix_cache_hit_tokens"] > 0
    for ours, theirs in zip(completions, again):
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
