"""The learner on a tiny Qwen3-MoE: the engine's routing carried from completions into the batch and
replayed in every forward pass (padded and packed), the mismatch metric and the router's
load-balancing loss."""

from __future__ import annotations

import pytest
import torch
from helpers.moe import VOCAB, other_experts, own_routing, tiny_moe

from grpoflow.engines import Completion
from grpoflow.learn.learner import Learner
from grpoflow.learn.logprobs import batch_logprobs
from grpoflow.learn.moe import MoeSettings
from grpoflow.learn.objective import AlgorithmConfig
from grpoflow.learn.update import UpdateSettings
from grpoflow.policy.placement import Placement
from grpoflow.policy.routing_replay import RoutingRecord, moe_routers
from grpoflow.policy.tiny import build_tiny_model
from grpoflow.rollout.batch import RolloutBatch, collate_pairs

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
COMPLETIONS = [[14, 15, 16, 17], [18, 19, 20, 21, 22, 23], [24]]


def _settings(moe: MoeSettings | None = None, **overrides) -> UpdateSettings:
    algorithm = AlgorithmConfig(moe=moe or MoeSettings())
    return UpdateSettings(
        algorithm=algorithm,
        micro_batch_size=3,
        temperature=1.0,
        max_completion_length=6,
        max_grad_norm=0.0,
        **overrides,
    )


def _recorded(model, prompt: list[int], tokens: list[int], change: bool = False) -> torch.Tensor:
    """The engine's record of a completion: the model's own experts (or others under `change`) for
    every position but the last sampled token, which was never fed."""
    routed = own_routing(model, torch.tensor([prompt + tokens]))
    routed = other_experts(routed) if change else routed
    routed[-1] = -1
    return routed


def _batch(model, change: bool = False) -> RolloutBatch:
    pairs = [
        (
            prompt,
            Completion(
                tokens, [0.0] * len(tokens), "stop", routed_experts=_recorded(model, prompt, tokens, change)
            ),
        )
        for prompt, tokens in zip(PROMPTS, COMPLETIONS)
    ]
    return collate_pairs(pairs, pad_token_id=0, device=torch.device("cpu"))


def _learn(model, batch: RolloutBatch, settings: UpdateSettings) -> tuple[dict, dict[str, float]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = Learner(Placement.local(model), optimizer, scheduler, settings)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = learner.learn(batch, torch.tensor([1.0, -1.0, 0.5]), sampling_logprobs=False)
    return {name: p.detach() - before[name] for name, p in model.named_parameters()}, metrics


def test_collated_routing_lines_up_with_the_model_inputs_and_survives_row_cuts():
    model = tiny_moe()
    batch = _batch(model)
    assert batch.routed_experts.shape == (3, 4 + 6, 2, 2) and batch.routed_experts.dtype == torch.int16
    assert bool((batch.routed_experts[1, :2] == -1).all())  # the left padding of a 2-token prompt
    assert bool((batch.routed_experts[2, 4 + 1 :] == -1).all())  # past the 1-token completion
    rows = batch.rows(1, 3)  # the longest prompt is row 2: no prompt column is cut; completions are
    assert rows.routed_experts.shape == (2, 4 + 6, 2, 2)
    first = batch.rows(0, 1)  # one prompt column and two completion columns go
    torch.testing.assert_close(first.routed_experts[0], _recorded(model, PROMPTS[0], COMPLETIONS[0]).short())
    with pytest.raises(
        ValueError, match=r"routed_experts has shape \(4, 2, 2\); its prompt and completion need \(3, 2, 2\)"
    ):
        bad = Completion([1], [0.0], "stop", routed_experts=torch.zeros(4, 2, 2, dtype=torch.long))
        collate_pairs([([1, 2], bad)], pad_token_id=0, device=torch.device("cpu"))


@pytest.mark.parametrize("padding_free", [False, True])
def test_replayed_routing_scores_as_the_engine_routed(padding_free):
    model = tiny_moe().eval()
    settings = _settings(padding_free=padding_free)
    routers = moe_routers(model)
    with torch.no_grad():
        plain = batch_logprobs(Placement.local(model), _batch(model), settings)[0]
        for change, same in ((False, True), (True, False)):
            with routers.hooked(RoutingRecord(replay=True)) as record:
                replayed = batch_logprobs(
                    Placement.local(model), _batch(model, change), settings, routing=record
                )[0]
            assert torch.allclose(replayed, plain, atol=1e-5) == same
            assert float(record.mismatch_fraction()) == (0.0 if same else 1.0)


def test_an_update_replaying_the_models_own_routing_is_the_plain_update_and_logs_no_mismatch():
    replayed, metrics = _learn(tiny_moe(), _batch(tiny_moe()), _settings(MoeSettings(router_aux_loss_coef=0)))
    off = MoeSettings(routing_replay=False, router_aux_loss_coef=0)
    plain, plain_metrics = _learn(tiny_moe(), _batch(tiny_moe()), _settings(off))
    assert metrics["routing/mismatch_fraction"] == 0.0 and "routing/mismatch_fraction" not in plain_metrics
    assert "loss/router_aux" not in metrics
    for name, delta in plain.items():
        torch.testing.assert_close(replayed[name], delta, rtol=1e-4, atol=1e-6)


def test_other_recorded_routing_moves_the_update_and_is_logged_as_mismatch():
    changed, metrics = _learn(tiny_moe(), _batch(tiny_moe(), change=True), _settings())
    plain, _ = _learn(
        tiny_moe(), _batch(tiny_moe(), change=True), _settings(MoeSettings(routing_replay=False))
    )
    assert metrics["routing/mismatch_fraction"] == 1.0
    router = "model.layers.0.mlp.gate.weight"
    assert changed[router].abs().sum() > 0 and not torch.allclose(changed[router], plain[router])


def test_the_router_aux_loss_is_the_models_own_and_joins_the_loss():
    model = tiny_moe()
    batch = _batch(model)
    input_ids, attention_mask = batch.model_inputs()
    with torch.no_grad():
        expected = model(
            input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True
        ).aux_loss
    with_aux, metrics = _learn(model, batch, _settings(MoeSettings(router_aux_loss_coef=10.0)))
    assert metrics["loss/router_aux"] == pytest.approx(float(expected), rel=1e-5)
    without, _ = _learn(tiny_moe(), _batch(tiny_moe()), _settings(MoeSettings(router_aux_loss_coef=0)))
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(with_aux[router], without[router])


def test_the_aux_loss_coefficient_defaults_to_the_models_and_replay_is_refused_where_it_cannot_run():
    model = tiny_moe()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    learner = Learner(Placement.local(model), optimizer, None, _settings())
    assert learner.moe.aux_loss_coef == model.config.router_aux_loss_coef == 0.001
    forced = Learner(Placement.local(model), optimizer, None, _settings(MoeSettings(routing_replay=True)))
    unrecorded = _batch(model)
    unrecorded.routed_experts = None
    with pytest.raises(ValueError, match="routing_replay: true needs every batch's routing recorded"):
        forced.learn(unrecorded, torch.zeros(3), sampling_logprobs=False)
    foreign = _batch(model)
    foreign.routed_experts[0, 0, 0, 0] = 8
    with pytest.raises(ValueError, match=r"recorded experts -1..8; the policy has experts 0..7"):
        forced.learn(foreign, torch.zeros(3), sampling_logprobs=False)
    dense = build_tiny_model(VOCAB)
    with pytest.raises(ValueError, match="needs a mixture-of-experts policy"):
        Learner(Placement.local(dense), optimizer, None, _settings(MoeSettings(routing_replay=True)))
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        MoeSettings(router_aux_loss_coef=-1.0)


def test_auto_replays_nothing_on_the_batch_invariant_kernels_and_true_still_replays():
    """The kernels' routers choose the engine's experts bit for bit: auto leaves replay off (and the
    engine records nothing); routing_replay: true replays as asked."""
    from grpoflow.policy.batch_invariant import BatchInvariantKernels

    assert MoeSettings().replays_recorded(kernels=False) and not MoeSettings().replays_recorded(kernels=True)
    assert MoeSettings(routing_replay=True).replays_recorded(kernels=True)
    assert not MoeSettings(routing_replay=False).replays_recorded(kernels=False)
    model = tiny_moe()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    BatchInvariantKernels.install(model)
    batch = _batch(model)
    auto = Learner(Placement.local(model), optimizer, None, _settings())
    assert not auto.moe.replays(batch)
    forced = Learner(Placement.local(model), optimizer, None, _settings(MoeSettings(routing_replay=True)))
    assert forced.moe.replays(batch)
