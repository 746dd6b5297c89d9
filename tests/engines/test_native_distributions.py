"""The native engine's whole next-token distributions at a sample of positions (CPU, float32):
as many as asked per call, each the model's own `log_softmax(logits / T)` at that position."""

from __future__ import annotations

import torch
from helpers.native_fixtures import tiny

from grpoflow.engines import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig

PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [12]]


def engine(model, positions):
    config = NativeEngineConfig(
        max_num_seqs=16, block_size=4, num_kv_blocks=256, distribution_positions=positions
    )
    return NativeEngine(model, config=config)


def test_a_call_keeps_the_asked_positions_each_the_models_distribution_there():
    torch.manual_seed(0)
    model = tiny()
    params = SamplingParams(n=3, max_tokens=10, temperature=0.7, top_k=20, seed=4, ignore_eos=True)
    outputs = engine(model, 8).generate(PROMPTS, params)
    kept = [
        (prompt, c, p, row)
        for prompt, group in zip(PROMPTS, outputs)
        for c in group
        for p, row in (c.distributions or {}).items()
    ]
    assert len(kept) == 8 and engine(model, 8).capabilities.distributions
    for prompt, completion, position, row in kept:
        ids = torch.tensor([prompt + completion.token_ids[:position]])
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float()
        assert torch.allclose(row, (logits / 0.7).log_softmax(-1), atol=1e-4)
    again = engine(model, 8).generate(PROMPTS, params)  # the same positions, whatever the batch
    assert [sorted(c.distributions or {}) for g in again for c in g] == [
        sorted(c.distributions or {}) for g in outputs for c in g
    ]


def test_no_positions_asked_none_kept():
    outputs = engine(tiny(), 0).generate(PROMPTS, SamplingParams(n=2, max_tokens=6, seed=1))
    assert all(c.distributions is None for group in outputs for c in group)
