"""A mixture-of-experts policy trained end to end: `grpoflow train` on a tiny random Qwen3-MoE
(8 experts, 2 per token) on the CPU, generated on the native engine's family path, which records
each position's experts for the update to replay, its router's load-balancing loss in the loss."""

from __future__ import annotations

import logging
import math

from helpers.support import read_jsonl, recipe
from safetensors.torch import load_file

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


def test_lora_on_the_experts_trains_on_the_family_path_and_the_engine_follows_it(tmp_path, caplog):
    """LoRA on the attention and on the fused experts (`target_parameters`): the engine adds the
    experts' adapters in its family forward (no generic-path line), its routing replays without a
    mismatch, and its log-probs stay the trainer's as the adapters train (B starts at zero)."""
    with caplog.at_level(logging.INFO, logger="grpoflow.engines.native"):
        metrics = run(
            recipe(
                tmp_path,
                model="random:tiny-moe",
                max_steps=3,
                per_device_train_batch_size=8,
                learning_rate=0.05,
                train_type="lora",
                lora_dropout=0.0,
                target_modules=["q_proj", "v_proj"],
                target_parameters=["experts.gate_up_proj", "experts.down_proj"],
                save_steps=3,
            )
        )
    assert not [record for record in caplog.records if "generic path" in record.getMessage()]
    assert len(metrics) == 3
    for step in metrics:
        assert step["routing/mismatch_fraction"] == 0
        assert step["sampling/sampling_logp_difference/max"] < 1e-3
    (checkpoint,) = (tmp_path / "run").glob("checkpoint-*")
    adapters = load_file(str(checkpoint / "adapter_model.safetensors"))
    experts_b = [tensor for name, tensor in adapters.items() if ".experts." in name and "lora_B" in name]
    assert len(experts_b) == 4 and all(tensor.abs().max() > 0 for tensor in experts_b)
