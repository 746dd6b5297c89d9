"""The memory plan's arithmetic against hand-computed cases."""

from __future__ import annotations

import dataclasses

import pytest

from grpoflow.policy.memory_plan import ModelShape, PlanSettings, activation_bytes, plan_memory

# h=8, 2 layers, 2 heads (head_dim 4), 1 kv head (kv width 4), intermediate 16, vocab 10, bf16.
SHAPE = ModelShape(
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=16,
    vocab_size=10,
    tie_word_embeddings=False,
    dtype_bytes=2,
)


def test_parameter_counts_by_hand():
    # Per layer: q 8*8=64, k 8*4=32, v 32, o 64, gate 8*16=128, up 128, down 128 -> 576, norms 16:
    # 592; two layers 1184; embedding and head 2*10*8=160; final norm 8: 1352.
    assert SHAPE.num_parameters() == 1352
    # LoRA rank 2 on q and v: 2*(8+8) + 2*(8+4) = 56 per layer, 112 over two layers.
    assert SHAPE.num_lora_parameters(2, ["q_proj", "v_proj"]) == 112
    # all-linear: 2 * (16+12+12+16+24+24+24) = 256 per layer, 512 in all.
    assert SHAPE.num_lora_parameters(2, ["all-linear"]) == 512


def test_full_fine_tune_with_reference_by_hand():
    settings = PlanSettings(micro_batch_size=2, sequence_length=4, logprob_chunk_size=5, reference_copy=True)
    plan = plan_memory(SHAPE, settings, capacity=10**6)
    weights = 1352 * 2  # bf16
    # Per token and layer without checkpointing: (6*8 + 2*4 + 4*16) * 2 + 2*8*4 = 240 + 64 = 304
    # bytes; 8 tokens, 2 layers: 4864.
    assert activation_bytes(SHAPE, settings) == 4864
    assert plan.update == {
        "weights": weights,
        "reference": weights,
        "optimizer": 2 * weights,  # AdamW's two moments in the weights' dtype
        "gradients": weights,
        "activations": 4864,
        "logits": 3 * 5 * 10 * 4,  # a chunk of 5 tokens' float32 logits, three times
    }
    assert plan.peak == 5 * weights + 4864 + 600 and plan.fits


def test_a_fused_activation_keeps_one_intermediate_vector_less():
    # Liger's SiLU-and-multiply keeps gate and up and recomputes the activation; the down
    # projection keeps their product: 3 * 16 where autograd's separate ops keep 4 * 16, per token
    # and layer in bf16 (8 tokens, 2 layers).
    settings = PlanSettings(micro_batch_size=2, sequence_length=4)
    fused = dataclasses.replace(settings, fused_activation=True)
    assert activation_bytes(SHAPE, fused) == activation_bytes(SHAPE, settings) - 16 * 2 * 8 * 2 == 4352
    # Under checkpointing the layers keep their inputs; only the one layer recomputed at a time
    # holds the vector less.
    checkpointed = dataclasses.replace(settings, gradient_checkpointing=True)
    fused_checkpointed = dataclasses.replace(checkpointed, fused_activation=True)
    assert activation_bytes(SHAPE, fused_checkpointed) == activation_bytes(SHAPE, checkpointed) - 16 * 2 * 8


def test_lora_with_checkpointing_and_offloads_by_hand():
    settings = PlanSettings(
        lora_rank=2,
        target_modules=["q_proj", "v_proj"],
        gradient_checkpointing=True,
        micro_batch_size=1,
        sequence_length=4,
        offload_optimizer=True,
        kv_cache_bytes=1000,
    )
    plan = plan_memory(SHAPE, settings, capacity=4000)
    # Checkpointed: per token 2 layers * 8 * 2 bytes = 32, plus one layer in full 304: 336; 4 tokens.
    assert activation_bytes(SHAPE, settings) == 4 * 336
    adapters = 112 * 4  # float32
    assert plan.rollout == {"weights": 2704, "adapters": adapters, "kv_cache": 1000}
    assert plan.update["gradients"] == adapters and "optimizer" not in plan.update
    # Update: weights 2704, adapters 448, their gradients 448, activations 1344, logits of the
    # 4 tokens 3*4*10*4 = 480: 5424, above the rollout's 2704 + 448 + 1000 = 4152.
    assert plan.peak == 5424 and plan.peak_phase == "update" and not plan.fits
    assert plan.largest_parts(2) == [("weights", 2704), ("activations", 1344)]


def test_fsdp_shards_resident_parts_and_gathers_for_rollouts():
    plan = plan_memory(SHAPE, PlanSettings(fsdp_world_size=4), capacity=10**6)
    assert plan.update["weights"] == 2704 // 4 and plan.update["optimizer"] == 2 * 2704 // 4
    # The rollout gathers the full weights beside each rank's shard.
    assert plan.rollout["weights"] == 2704 // 4 and plan.rollout["gathered_weights"] == 2704
    assert "fused_copies" not in plan.rollout  # no native engine in the run
    # The native engine multiplies by copies of each layer's q/k/v weights (8 x (8 + 4 + 4)) and
    # gate/up weights (2 x 8 x 16) laid back to back: 384 parameters a layer, 2 layers.
    native = plan_memory(SHAPE, PlanSettings(fsdp_world_size=4, fused_copies=True), capacity=10**6)
    assert native.rollout["fused_copies"] == 2 * 384 * 2 and "fused_copies" not in native.update
    assert "fused_copies" not in plan_memory(SHAPE, PlanSettings(fused_copies=True), 10**6).rollout


def test_fsdp_reducing_once_per_step_holds_the_full_gradients_on_every_rank():
    settings = PlanSettings(fsdp_world_size=2, accumulated_gradient_bytes=4)
    plan = plan_memory(SHAPE, settings, capacity=10**6)
    # 1352 parameters' float32 gradients in full, in place of the bf16 shard of them (made from
    # the full ones by the step's last reduce-scatter).
    assert plan.update["accumulated_gradients"] == 1352 * 4 and "gradients" not in plan.update
    every_micro_batch = plan_memory(SHAPE, PlanSettings(fsdp_world_size=2), capacity=10**6)
    assert every_micro_batch.update["gradients"] == 2704 // 2
    # Without reshard-after-forward the update holds the full weights as the rollout does.
    kept = plan_memory(SHAPE, PlanSettings(fsdp_world_size=2, fsdp_reshard_after_forward=False), 10**6)
    assert kept.update["gathered_weights"] == kept.rollout["gathered_weights"] == 2704
    assert "gathered_weights" not in plan.update
    lora = PlanSettings(lora_rank=2, target_modules=["q_proj", "v_proj"], accumulated_gradient_bytes=4)
    assert plan_memory(SHAPE, lora, capacity=10**6).update["accumulated_gradients"] == 112 * 4


def test_the_optimizer_step_raises_the_peak_by_what_outlives_the_backward_pass():
    settings = PlanSettings(micro_batch_size=1, sequence_length=2, logprob_chunk_size=1)
    fused = plan_memory(SHAPE, settings, capacity=10**6)
    foreach = plan_memory(SHAPE, dataclasses.replace(settings, optimizer_temporaries=True), 10**6)
    # Activations 2 tokens * 2 layers * 304 = 1216, logits 3*1*10*4 = 120: the step's temporary
    # (2704, the trained weights' size) adds 2704 - 1216 - 120 = 1368 to the update's peak.
    assert "optimizer_step" not in fused.update
    assert foreach.update["optimizer_step"] == 1368
    assert foreach.peak == fused.peak + 1368
    # Offloaded moments (2 x 2704) come back for the step: 5408 - 1336 above the backward pass,
    # though the rollout and the backward pass hold none of them.
    offloaded = plan_memory(SHAPE, dataclasses.replace(settings, offload_optimizer=True), 10**6)
    assert "optimizer" not in offloaded.rollout and "optimizer" not in offloaded.update
    assert offloaded.update["optimizer_step"] == 2 * 2704 - 1216 - 120
    # With more activations than the temporary needs, the step adds nothing.
    big = PlanSettings(micro_batch_size=8, sequence_length=4, optimizer_temporaries=True)
    assert "optimizer_step" not in plan_memory(SHAPE, big, capacity=10**6).update


def test_settings_are_checked():
    with pytest.raises(ValueError, match="micro_batch_size"):
        PlanSettings(micro_batch_size=0)
    with pytest.raises(ValueError, match="prompt_length"):
        PlanSettings(sequence_length=4, prompt_length=4)


@pytest.mark.parametrize(
    "micro_batch, prompts",
    [(16, 2), (12, 3), (4, 2), (1, 1)],  # 12 and 4 straddle a group: parts of one more prompt
)
def test_shared_prompts_keep_each_groups_prompt_once(micro_batch, prompts):
    """8 completions a prompt, prompt 6 tokens and completion 10: the padded micro-batch's
    activations less the repeated prompts'."""
    padded = PlanSettings(micro_batch_size=micro_batch, sequence_length=16, prompt_length=6)
    shared = dataclasses.replace(padded, completions_per_prompt=8)
    assert padded.micro_batch_tokens == micro_batch * 16
    assert shared.micro_batch_tokens == micro_batch * 10 + prompts * 6
    per_token = activation_bytes(SHAPE, padded) // padded.micro_batch_tokens
    assert activation_bytes(SHAPE, shared) == per_token * shared.micro_batch_tokens


def test_a_moe_models_parameters_are_every_expert_and_router_as_the_model_holds_them():
    from helpers.moe import tiny_moe

    for overrides in ({}, {"mlp_only_layers": [1], "intermediate_size": 48}):
        model = tiny_moe(**overrides)
        shape = ModelShape.from_config(model.config, dtype_bytes=4)
        assert shape.num_moe_layers == (2 if not overrides else 1) and shape.num_experts == 8
        assert shape.num_parameters() == sum(p.numel() for p in model.parameters())


def test_a_moe_layers_activations_are_its_routed_experts():
    dense = dataclasses.replace(SHAPE, num_hidden_layers=1)
    moe = dataclasses.replace(
        dense, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4, num_moe_layers=1
    )
    settings = PlanSettings(micro_batch_size=1, sequence_length=1)
    # The dense MLP's 4 * 16 intermediate values (bf16) give way to 2 routed experts' hidden copies
    # in and out and their 4 * 4 intermediate values, and the router's float32 logits and probs.
    routed = 2 * (2 * 8 + 4 * 4) * 2 + 2 * 8 * 4
    assert activation_bytes(moe, settings) == activation_bytes(dense, settings) - 4 * 16 * 2 + routed
    # LoRA on all-linear adapts a MoE layer's attention only: its experts are not linear layers.
    assert moe.num_lora_parameters(2, ["all-linear"]) == 2 * (16 + 12 + 12 + 16)


def test_lora_on_the_experts_counts_every_experts_adapter_as_peft_makes_them():
    pytest.importorskip("peft")
    from helpers.moe import tiny_moe

    from grpoflow.policy.lora import AdapterConfig

    experts = ["experts.gate_up_proj", "experts.down_proj"]
    for modules, parameters in ((["all-linear"], experts), (["q_proj"], experts[:1]), (["q_proj"], [])):
        model = tiny_moe()
        shape = ModelShape.from_config(model.config, dtype_bytes=4)
        config = AdapterConfig(
            train_type="lora",
            lora_rank=2,
            lora_dropout=0.0,
            target_modules=modules,
            target_parameters=parameters,
        )
        policy = config.apply(model)
        trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        assert shape.num_lora_parameters(2, modules, parameters) == trained


def test_expert_parallel_experts_are_never_gathered_in_the_update_nor_their_gradients_accumulated():
    # One MoE layer of 4 experts of 3 * 8 * 4 = 96 weights each: 384 expert weights.
    moe = dataclasses.replace(
        SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4, num_moe_layers=1
    )
    layout = {"fsdp_world_size": 2, "fsdp_reshard_after_forward": False, "accumulated_gradient_bytes": 4}
    fsdp = plan_memory(moe, PlanSettings(**layout), capacity=10**6)
    split = plan_memory(moe, PlanSettings(**layout, expert_parallel=True), capacity=10**6)
    assert split.rollout == fsdp.rollout  # the rollout gathers every expert either way
    assert split.update["weights"] == fsdp.update["weights"] == moe.num_parameters() * 2 // 2
    assert split.update["gathered_weights"] == fsdp.update["gathered_weights"] - 384 * 2
    assert split.update["accumulated_gradients"] == fsdp.update["accumulated_gradients"] - 192 * 4
