"""Routing replay on a tiny random Qwen3-MoE: the engine's experts where recorded, the router's own
elsewhere, the router's probabilities as the gate weights (and its gradient), and the mismatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.live_bytes import peak_live_bytes
from helpers.moe import VOCAB, other_experts, own_routing, tiny_moe

from grpoflow.policy.routing_replay import RoutingRecord, moe_routers


def replayed_logits(
    model, input_ids: torch.Tensor, routed: torch.Tensor
) -> tuple[torch.Tensor, RoutingRecord]:
    routers = moe_routers(model)
    with routers.hooked(RoutingRecord(replay=True)) as record:
        record.bind(routed, None)
        logits = model(input_ids=input_ids).logits
    return logits, record


def test_replaying_the_models_own_routing_changes_nothing():
    model = tiny_moe().eval()
    input_ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=input_ids).logits
        replayed, record = replayed_logits(model, input_ids, own_routing(model, input_ids))
    torch.testing.assert_close(replayed, plain, rtol=1e-5, atol=1e-6)
    assert float(record.mismatch_fraction()) == 0.0


def test_other_recorded_experts_change_the_output_as_computed_by_hand():
    model = tiny_moe()
    block = model.model.layers[0].mlp
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    own = moe_routers(block).routers[0](hidden)[2]
    recorded = other_experts(own)
    recorded[4] = -1  # not fed: the router's own choice
    with torch.no_grad(), moe_routers(block).hooked(RoutingRecord(replay=True)) as record:
        record.bind(recorded[:, None], None)
        out = block(hidden[None])[0]
        plain = block.experts(hidden, own, moe_routers(block).routers[0](hidden)[1])
    experts = torch.where(recorded >= 0, recorded, own)
    probs = torch.softmax(hidden @ block.gate.weight.T, dim=-1)
    expected = torch.zeros_like(hidden)
    for token in range(5):
        for expert in experts[token].tolist():
            gate, up = F.linear(hidden[token], block.experts.gate_up_proj[expert]).chunk(2)
            value = F.linear(F.silu(gate) * up, block.experts.down_proj[expert])
            expected[token] += probs[token, expert] * value  # norm_topk_prob is off in Qwen3-MoE
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out[:4], plain[:4])
    torch.testing.assert_close(out[4], plain[4], rtol=1e-5, atol=1e-6)
    assert float(record.mismatch_fraction()) == 1.0  # 4 recorded tokens, all sent elsewhere


def test_the_router_gets_gradients_through_replayed_experts():
    model = tiny_moe()
    input_ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    recorded = other_experts(own_routing(model, input_ids))
    logits, _ = replayed_logits(model, input_ids, recorded)
    logits.logsumexp(-1).sum().backward()
    for router in moe_routers(model).routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_the_mismatch_fraction_counts_recorded_token_layers_whose_own_set_differs():
    model = tiny_moe().eval()
    input_ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    own = own_routing(model, input_ids)  # (16, 2, 2)
    recorded = own.clone()
    recorded[:3, 1] = other_experts(own[:3, 1])  # 3 tokens of the last layer differ
    recorded[3, 0] = own[3, 0].flip(0)  # the same set in another order: no mismatch
    recorded[4:6] = -1  # 2 tokens not fed: 4 (token, layer) routings not counted
    with torch.no_grad():
        _, record = replayed_logits(model, input_ids, recorded)
    assert float(record.mismatch_fraction()) == pytest.approx(3 / (16 * 2 - 4))


def test_gradient_checkpointing_recomputes_the_replayed_routing():
    input_ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    grads = []
    for checkpointing in (False, True):
        model = tiny_moe().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        logits, _ = replayed_logits_kept(model, input_ids, other_experts(own_routing(model, input_ids)))
        grads.append(model.model.layers[0].mlp.gate.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0])


def replayed_logits_kept(
    model, input_ids: torch.Tensor, routed: torch.Tensor
) -> tuple[torch.Tensor, RoutingRecord]:
    """A forward and backward pass with the routers hooked throughout (as the learner keeps them)."""
    with moe_routers(model).hooked(RoutingRecord(replay=True)) as record:
        record.bind(routed, None)
        logits = model(input_ids=input_ids, use_cache=False).logits
        logits.logsumexp(-1).sum().backward()
    return logits, record


def test_the_load_balancing_loss_under_checkpointing_keeps_no_recomputed_graph():
    """The routers run again in the backward pass; logits kept from there would hold every layer's
    recomputed activations until the micro-batch ends (10 GiB at the 8-layer Qwen3-30B-A3B shape)."""
    model = tiny_moe(num_hidden_layers=4).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    routers = moe_routers(model)
    input_ids = torch.randint(0, VOCAB, (4, 256), generator=torch.Generator().manual_seed(5))

    def step(aux: bool) -> None:
        with routers.hooked(RoutingRecord(keep_logits=aux)) as record:
            loss = model(input_ids=input_ids, use_cache=False).logits.float().logsumexp(-1).mean()
            if aux:
                loss = loss + routers.aux_loss(record)
            loss.backward()
        assert not record.logits
        model.zero_grad(set_to_none=True)

    without, with_aux = peak_live_bytes(lambda: step(False)), peak_live_bytes(lambda: step(True))
    assert with_aux < 1.05 * without, (with_aux, without)
