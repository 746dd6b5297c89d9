"""LoRA on a tiny Qwen3-MoE: adapters on its linear layers outside the experts train, and a
target that names no linear layer of a MoE model (its experts are fused parameters) is refused
with the layers it has; adapters on the fused experts (`target_parameters`) train under routing
replay, travel merged to engines with their own weights, and name the parameters a model has."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from helpers.moe import VOCAB, own_routing, tiny_moe  # noqa: E402

from grpoflow.engines.native import NativeEngine, NativeEngineConfig  # noqa: E402
from grpoflow.engines.vllm_adapters import adapter_obstacle, expert_adapter_obstacle  # noqa: E402
from grpoflow.learn.learner import Learner  # noqa: E402
from grpoflow.learn.objective import AlgorithmConfig  # noqa: E402
from grpoflow.learn.update import UpdateSettings  # noqa: E402
from grpoflow.policy.lora import (  # noqa: E402
    AdapterConfig,
    RolloutParts,
    merged_adapters,
    merged_weights,
    rollout_parts,
)
from grpoflow.policy.placement import Placement  # noqa: E402
from grpoflow.policy.tiny import build_tiny_model  # noqa: E402
from grpoflow.remote.capabilities import ServerOffer, adapters_alone  # noqa: E402
from grpoflow.rollout.batch import RolloutBatch  # noqa: E402


def _batch() -> RolloutBatch:
    generator = torch.Generator().manual_seed(0)
    return RolloutBatch(
        prompt_ids=torch.randint(0, VOCAB, (2, 4), generator=generator),
        prompt_mask=torch.ones(2, 4, dtype=torch.long),
        completion_ids=torch.randint(0, VOCAB, (2, 5), generator=generator),
        completion_mask=torch.ones(2, 5, dtype=torch.long),
        sampling_logps=torch.zeros(2, 5),
        truncated=torch.zeros(2, dtype=torch.bool),
    )


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"]])
def test_lora_on_a_moe_models_linear_layers_trains_and_merges(targets):
    policy = AdapterConfig(train_type="lora", target_modules=targets, lora_rank=4).apply(tiny_moe())
    trained = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trained and all("self_attn" in name and "lora_" in name for name in trained)
    settings = UpdateSettings(
        algorithm=AlgorithmConfig(),
        micro_batch_size=2,
        temperature=1.0,
        max_completion_length=5,
        max_grad_norm=0.0,
    )
    parameters = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(parameters, lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = Learner(Placement.local(policy), optimizer, scheduler, settings)
    before = [p.detach().clone() for p in parameters]
    metrics = learner.learn(_batch(), torch.tensor([1.0, -1.0]), sampling_logprobs=False)
    assert metrics["loss/router_aux"] > 0
    assert any(not torch.equal(p, b) for p, b in zip(parameters, before))
    merged = dict(merged_weights(policy))
    assert (
        "model.layers.0.mlp.experts.gate_up_proj" in merged
        and "model.layers.0.self_attn.q_proj.weight" in merged
    )


@pytest.mark.parametrize("target", ["gate_proj", "experts", "gate"])
def test_a_target_that_a_moe_layer_lacks_is_named_with_its_linear_layers(target):
    with pytest.raises(
        ValueError, match=rf"target_modules \['{target}'\] name no linear layer of this mixture-of-experts"
    ) as error:
        AdapterConfig(train_type="lora", target_modules=[target]).apply(tiny_moe())
    assert "target its linear layers (k_proj, o_proj, q_proj, v_proj) or all-linear" in str(error.value)


EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def _expert_policy(**overrides) -> torch.nn.Module:
    config = dict(train_type="lora", target_modules=["q_proj"], target_parameters=EXPERTS, lora_rank=4)
    return AdapterConfig(**{"lora_dropout": 0.0, **config, **overrides}).apply(tiny_moe())


def _recorded_batch(policy) -> RolloutBatch:
    """`_batch` with the routing the policy's routers choose recorded, as the engine records it."""
    batch = _batch()
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    routed = torch.stack([own_routing(policy, row[None]) for row in ids])
    routed[:, -1] = -1  # the last sampled token was never fed
    batch.routed_experts = routed.short()
    return batch


def test_lora_on_the_experts_trains_replaying_the_routing():
    """Every expert's adapter trains (B starts at zero, so the first step moves B, not A), and the
    routers' hooks still replay with the experts wrapped by PEFT: the policy's own routing, replayed,
    mismatches nowhere."""
    policy = _expert_policy()
    trained = {name: p for name, p in policy.named_parameters() if p.requires_grad}
    experts = {name: p for name, p in trained.items() if ".experts." in name}
    assert len(experts) == 2 * 2 * 2  # A and B of 2 parameters in 2 MoE layers
    assert all(p.shape[0] == 4 * 8 for name, p in experts.items() if "lora_A" in name)  # rank x experts
    settings = UpdateSettings(
        algorithm=AlgorithmConfig(),
        micro_batch_size=2,
        temperature=1.0,
        max_completion_length=5,
        max_grad_norm=0.0,
    )
    optimizer = torch.optim.SGD(list(trained.values()), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = Learner(Placement.local(policy), optimizer, scheduler, settings)
    before = {name: p.detach().clone() for name, p in experts.items()}
    metrics = learner.learn(_recorded_batch(policy), torch.tensor([1.0, -1.0]), sampling_logprobs=False)
    assert metrics["routing/mismatch_fraction"] == 0 and metrics["loss/router_aux"] > 0
    assert all(not torch.equal(experts[name], before[name]) for name in experts if "lora_B" in name)


def test_merged_weights_carry_the_expert_adapters():
    """The weights an engine with its own copy loads, and the hf engine's merged module, compute
    PEFT's forward; the base comes back bit for bit after the merge."""
    policy = _expert_policy()
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    base = {name: p.detach().clone() for name, p in policy.get_base_model().named_parameters()}
    plain = tiny_moe()
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
        assert not torch.allclose(plain(input_ids=ids).logits, expected, atol=1e-2)
        missing, unexpected = plain.load_state_dict(dict(merged_weights(policy)), strict=False)
        assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
        torch.testing.assert_close(plain(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
        with merged_adapters(policy):
            merged = policy.get_base_model()(input_ids=ids).logits
        torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-4)
    assert all(torch.equal(p, base[name]) for name, p in policy.get_base_model().named_parameters())


def test_expert_adapters_travel_merged_to_engines_that_take_adapters():
    """A native engine over its own copy of the model (as `grpoflow serve` runs it), colocated
    vLLM and rollout servers take a policy's adapters alone, but not those on the experts."""
    policy = _expert_policy()
    engine = NativeEngine(tiny_moe(), config=NativeEngineConfig(max_num_seqs=2))
    assert engine.capabilities.accepts_adapters and engine.holds_base
    assert rollout_parts(policy, engine) == RolloutParts()
    assert "model.layers.0.mlp.experts adapts fused expert parameters" in expert_adapter_obstacle(policy)
    assert "adapts fused expert parameters" in adapter_obstacle(policy)
    server = ServerOffer("http://native", "m", None, False, "cpu", True, "native", None)
    assert not adapters_alone([server], policy)  # grpoflow serve's native engine gets them merged
    attention = AdapterConfig(train_type="lora", target_modules=["q_proj"]).apply(tiny_moe())
    assert rollout_parts(attention, engine) == RolloutParts(adapters=True, with_base=False)


def test_target_parameters_name_the_experts_a_model_has_and_need_no_dropout():
    with pytest.raises(
        ValueError,
        match=r"target_parameters \['experts.up_proj'\] name no fused expert parameter of this model: "
        r"it has experts.down_proj, experts.gate_up_proj",
    ):
        _expert_policy(target_parameters=["experts.up_proj"])
    with pytest.raises(
        ValueError, match=r"target_parameters \['experts.gate_up_proj'\]: this model has no fused"
    ):
        AdapterConfig(train_type="lora", lora_dropout=0.0, target_parameters=EXPERTS[:1]).apply(
            build_tiny_model(VOCAB)
        )
    with pytest.raises(ValueError, match=r"needs lora_dropout 0 .* got 0.05: set lora_dropout: 0"):
        AdapterConfig(train_type="lora", target_parameters=EXPERTS)


def test_dense_mlp_names_that_peft_moves_onto_the_experts_are_refused():
    """With a dense layer beside the sparse ones, all-linear includes its gate/up/down_proj, which
    PEFT reads as the experts' old names: it would adapt the experts instead of those layers."""
    model = tiny_moe(mlp_only_layers=[1], intermediate_size=48)
    with pytest.raises(
        ValueError,
        match=r"target_modules \['down_proj', 'gate_proj', 'up_proj'\]: on this mixture-of-experts model PEFT "
        r"takes these names for its fused experts and would adapt down_proj, gate_up_proj",
    ):
        AdapterConfig(train_type="lora", lora_dropout=0.0).apply(model)
    policy = _expert_policy(target_modules=["q_proj", "o_proj"])
    assert set(policy.peft_config["default"].target_parameters) == set(EXPERTS)
