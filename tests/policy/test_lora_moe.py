"""LoRA on a tiny Qwen3-MoE: adapters on its linear layers outside the experts train, and a
target that names no linear layer of a MoE model (its experts are fused parameters) is refused
with the layers it has."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from helpers.moe import VOCAB, tiny_moe  # noqa: E402

from grpoflow.learn.learner import Learner  # noqa: E402
from grpoflow.learn.objective import AlgorithmConfig  # noqa: E402
from grpoflow.learn.update import UpdateSettings  # noqa: E402
from grpoflow.policy.lora import AdapterConfig, merged_weights  # noqa: E402
from grpoflow.policy.placement import Placement  # noqa: E402
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
