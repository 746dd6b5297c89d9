"""A mixture-of-experts policy trained end to end: `grpoflow train` on a tiny random Qwen3-MoE
(8 experts, 2 per token) on the CPU, generated on the native engine's family path, which records
each position's experts for the update to replay, its router's load-balancing loss in the loss."""

from __future__ import annotations

import math

from helpers.support import read_jsonl, recipe

from grpoflow.run.build import run


def test_a_tiny_qwen3_moe_trains_replaying_the_engines_routing_with_its_router_aux_loss(tmp_path):
    metrics = run(
        recipe(
            tmp_path, model="random:tiny-moe", max_steps=2, per_device_train_batch_size=8, learning_rate=0.05
        )
    )
    assert len(metrics) == 2
    for step in metrics:
        assert step["loss/router_aux"] > 0 and math.isfinite(step["loss"]) and step["weights/nonfinite"] == 0
        assert 0 <= step["routing/mismatch_fraction"] < 0.05  # the engine's routing, replayed
        assert step["sampling/sampling_logp_difference/max"] < 1e-3
    logged = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all("loss/router_aux" in row for row in logged)
