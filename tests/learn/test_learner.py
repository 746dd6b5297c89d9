"""The learner: the importance-sampling correction against the engine's log-probs, forward passes
through the given placements, padding-free (packed) updates and token-budget micro-batches."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.plugin_loss import scaled_loss

from grpoflow.learn.learner import Learner, load_optimizer_state
from grpoflow.learn.logprobs import batch_logprobs
from grpoflow.learn.micro_batches import micro_batches
from grpoflow.learn.objective import AlgorithmConfig
from grpoflow.learn.update import ImportanceCorrection, UpdateSettings
from grpoflow.policy import varlen_attention
from grpoflow.policy.placement import Placement
from grpoflow.policy.tiny import build_tiny_model
from grpoflow.rollout.batch import RolloutBatch
from grpoflow.run.config import TrainingConfig

VOCAB = 40


def _settings(**overrides) -> UpdateSettings:
    return UpdateSettings(
        **{"algorithm": AlgorithmConfig(), "max_completion_length": 6, "max_grad_norm": 0.0, **overrides}
    )


def _learner(
    placement: Placement, settings: UpdateSettings, ref_placement: Placement | None = None, lr: float = 1.0
) -> Learner:
    """A learner with plain SGD at a constant learning rate."""
    optimizer = torch.optim.SGD(placement.module.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Learner(placement, optimizer, scheduler, settings, ref_placement=ref_placement)


def _batch(model, settings) -> RolloutBatch:
    generator = torch.Generator().manual_seed(0)
    batch = RolloutBatch(
        prompt_ids=torch.randint(0, VOCAB, (4, 5), generator=generator),
        prompt_mask=torch.ones(4, 5, dtype=torch.long),
        completion_ids=torch.randint(0, VOCAB, (4, 6), generator=generator),
        completion_mask=torch.ones(4, 6, dtype=torch.long),
        sampling_logps=torch.zeros(4, 6),
        truncated=torch.zeros(4, dtype=torch.bool),
    )
    with torch.no_grad():
        batch.sampling_logps = batch_logprobs(Placement.local(model), batch, settings)[0]
    return batch


def _train(correction: ImportanceCorrection | None, shift: float) -> tuple[dict, dict[str, float]]:
    """Parameters after one update on a fixed batch whose engine log-probs are the policy's minus
    `shift` nats per token, and the update's metrics."""
    model = build_tiny_model(VOCAB, seed=0)
    settings = _settings(micro_batch_size=2, temperature=1.0, sampling_correction=correction)
    batch = _batch(model, settings)
    batch.sampling_logps = batch.sampling_logps - shift
    learner = _learner(Placement.local(model), settings)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = learner.learn(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    return {name: p.detach() - before[name] for name, p in model.named_parameters()}, metrics


def test_matching_engine_log_probs_change_nothing():
    plain, _ = _train(None, 0.0)
    corrected, metrics = _train(ImportanceCorrection(vllm_importance_sampling_mode="token_truncate"), 0.0)
    for name in plain:
        torch.testing.assert_close(corrected[name], plain[name], rtol=1e-5, atol=1e-7)
    assert metrics["sampling/importance_sampling_ratio/mean"] == 1.0


def test_token_ratios_scale_the_update_and_masked_ones_drop_it():
    plain, _ = _train(None, 0.0)
    # The engine gave every token log(2) nats less: every ratio is 2 (SGD: the step doubles).
    doubled, metrics = _train(
        ImportanceCorrection(vllm_importance_sampling_mode="token_truncate"), math.log(2)
    )
    for name in plain:
        torch.testing.assert_close(doubled[name], 2 * plain[name], rtol=1e-4, atol=1e-6)
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(2.0, rel=1e-5)
    # A sequence ratio of 2^6 is outside the range: every sequence is masked, nothing moves.
    masked, _ = _train(ImportanceCorrection(vllm_importance_sampling_mode="sequence_mask"), math.log(2))
    assert all(torch.count_nonzero(delta) == 0 for delta in masked.values())


def test_batches_without_left_padding_skip_the_mask_and_score_the_same():
    model = build_tiny_model(VOCAB, seed=0)
    settings = _settings(micro_batch_size=4, temperature=0.8)
    batch = _batch(model, settings)
    batch.completion_mask[1, 3:] = 0  # right padding: hidden by the causal mask alone
    batch.completion_mask[2, 1:] = 0
    batch.left_padded = False
    unmasked = batch_logprobs(Placement.local(model), batch, settings)[0]
    batch.left_padded = True
    masked = batch_logprobs(Placement.local(model), batch, settings)[0]
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(unmasked[mask], masked[mask], rtol=1e-5, atol=1e-5)


class CountingPlacement(Placement):
    """A replicated placement that counts the forward passes and uses run through it."""

    __slots__ = ("forwards", "uses")

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module=module, device=torch.device("cpu"))
        self.forwards, self.uses = 0, 0

    def sharded_forward(self, function):
        self.forwards += 1
        return super().sharded_forward(function)

    def in_use(self):
        self.uses += 1
        return super().in_use()


def test_every_forward_pass_runs_through_the_placements_it_is_given():
    model, ref_model = build_tiny_model(VOCAB, seed=0), build_tiny_model(VOCAB, seed=1)
    settings = _settings(
        micro_batch_size=2, temperature=1.0, algorithm=AlgorithmConfig(beta=0.1, num_iterations=2)
    )
    batch = _batch(model, settings)
    policy, reference = CountingPlacement(model), CountingPlacement(ref_model)
    _learner(policy, settings, reference, lr=0.1).learn(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    # Two micro-batches: old log-probs once, then the loss's forward in each of two iterations.
    assert (policy.forwards, policy.uses) == (2 + 2 * 2, 0)
    assert (reference.forwards, reference.uses) == (2, 1)


def _ragged_batch(model, settings) -> RolloutBatch:
    """Six completions of very different lengths behind prompts of different lengths; the fourth has
    environment tokens (no loss) in its middle."""
    prompt_lengths, completion_lengths = [2, 7, 4, 1, 5, 3], [30, 2, 11, 18, 1, 6]
    generator = torch.Generator().manual_seed(1)
    rows, prompt_len, completion_len = 6, max(prompt_lengths), max(completion_lengths)
    prompt_mask = torch.zeros(rows, prompt_len, dtype=torch.long)
    completion_mask = torch.zeros(rows, completion_len, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt_mask[row, prompt_len - p :] = 1
        completion_mask[row, :c] = 1
    loss_mask = completion_mask.clone()
    loss_mask[3, 5:9] = 0
    batch = RolloutBatch(
        prompt_ids=torch.randint(3, VOCAB, (rows, prompt_len), generator=generator),
        prompt_mask=prompt_mask,
        completion_ids=torch.randint(3, VOCAB, (rows, completion_len), generator=generator),
        completion_mask=completion_mask,
        sampling_logps=torch.zeros(rows, completion_len),
        truncated=torch.zeros(rows, dtype=torch.bool),
        loss_mask=loss_mask,
    )
    with torch.no_grad():
        batch.sampling_logps = batch_logprobs(Placement.local(model), batch, settings)[0] - 0.01
    return batch


RAGGED_ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.25, -0.25])


def _ragged_update(settings: UpdateSettings, beta: float = 0.0) -> tuple[dict, dict[str, float]]:
    """Parameter change of one update (SGD, lr 1) on the ragged batch, and the metrics."""
    model = build_tiny_model(VOCAB, seed=0)
    batch = _ragged_batch(model, _settings(micro_batch_size=6, temperature=0.9))
    ref = Placement.local(build_tiny_model(VOCAB, seed=1)) if beta else None
    learner = _learner(Placement.local(model), settings, ref)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = learner.learn(batch, RAGGED_ADVANTAGES)
    return {name: p.detach() - before[name] for name, p in model.named_parameters()}, metrics


def _assert_same_update(actual: dict, expected: dict) -> None:
    """Equal float32 updates: within 1e-4 of each tensor's largest change (packed and padded
    passes sum in other orders, about 1e-5 apart after two optimizer steps)."""
    for name, delta in expected.items():
        scale = delta.abs().max().clamp(min=1e-6)
        torch.testing.assert_close(actual[name] / scale, delta / scale, rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo", "luspo"])
def test_padding_free_updates_as_the_padded_micro_batches_do(loss_type):
    """Old-policy (num_iterations 2), reference (beta) and trained log-probs all packed."""
    algorithm = AlgorithmConfig(loss_type=loss_type, num_iterations=2, beta=0.05)
    common = dict(micro_batch_size=2, temperature=0.9, algorithm=algorithm)
    padded, padded_metrics = _ragged_update(_settings(**common), beta=0.05)
    packed, packed_metrics = _ragged_update(_settings(**common, padding_free=True), beta=0.05)
    _assert_same_update(packed, padded)
    for name in ("loss", "kl", "entropy"):
        assert packed_metrics[name] == pytest.approx(padded_metrics[name], rel=1e-4, abs=1e-6), name


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "luspo", "sapo", "cispo"])
def test_token_budget_micro_batches_add_up_to_the_whole_batch(loss_type):
    """Unequal micro-batches under a token budget give the update of one micro-batch of the whole
    batch: per token or per sequence over the whole batch, as the loss type defines."""
    algorithm = AlgorithmConfig(loss_type=loss_type)
    whole, whole_metrics = _ragged_update(_settings(micro_batch_size=6, temperature=0.9, algorithm=algorithm))
    budget = _settings(
        micro_batch_size=6,
        temperature=0.9,
        algorithm=algorithm,
        padding_free=True,
        max_tokens_per_micro_batch=36,
    )
    model = build_tiny_model(VOCAB, seed=0)
    sizes = [len(part) for part in micro_batches(_ragged_batch(model, budget), budget)]
    assert sizes == [1, 2, 3]  # 32 | 9 + 15 | 19 + 6 + 9 tokens
    split, split_metrics = _ragged_update(budget)
    _assert_same_update(split, whole)
    assert split_metrics["loss"] == pytest.approx(whole_metrics["loss"], rel=1e-4, abs=1e-6)


def test_padding_free_reward_kl_equals_the_padded_one():
    model, ref_model = build_tiny_model(VOCAB, seed=0), build_tiny_model(VOCAB, seed=1)
    algorithm = AlgorithmConfig(beta=0.1, kl_in_reward=True)
    padded_settings = _settings(micro_batch_size=4, temperature=1.0, algorithm=algorithm)
    batch = _ragged_batch(model, padded_settings)
    packed_settings = _settings(
        micro_batch_size=4,
        temperature=1.0,
        algorithm=algorithm,
        padding_free=True,
        max_tokens_per_micro_batch=40,
    )
    policy, reference = Placement.local(model), Placement.local(ref_model)
    padded = _learner(policy, padded_settings, reference).reward_kl(batch)
    packed = _learner(policy, packed_settings, reference).reward_kl(batch)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)


def test_a_token_budget_needs_padding_free():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch.*padding_free: true"):
        TrainingConfig(max_tokens_per_micro_batch=4096)
    assert (
        TrainingConfig(padding_free=True, max_tokens_per_micro_batch=4096).max_tokens_per_micro_batch == 4096
    )


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "luspo"])
@pytest.mark.parametrize("padding_free", [False, True])
def test_micro_batches_grouped_by_length_update_as_the_batch_in_order(loss_type, padding_free):
    """Rows reordered longest first (their advantages with them): the same update, old-policy,
    reference and trained log-probs included, from micro-batches with less padding."""
    algorithm = AlgorithmConfig(loss_type=loss_type, num_iterations=2, beta=0.05)
    common = dict(micro_batch_size=2, temperature=0.9, algorithm=algorithm, padding_free=padding_free)
    in_order, in_order_metrics = _ragged_update(_settings(**common), beta=0.05)
    grouped, grouped_metrics = _ragged_update(_settings(**common, group_by_length=True), beta=0.05)
    _assert_same_update(grouped, in_order)
    # Per-token metrics such as kl are means of micro-batch means, so they move with the grouping.
    assert grouped_metrics["loss"] == pytest.approx(in_order_metrics["loss"], rel=1e-4, abs=1e-6)


def test_grouping_by_length_cuts_the_padded_rectangles():
    model = build_tiny_model(VOCAB, seed=0)
    settings = _settings(micro_batch_size=2, temperature=1.0)
    batch = _ragged_batch(model, settings)
    order = batch.by_length()
    assert order.tolist() == [0, 3, 2, 1, 5, 4]  # lengths 32 9 15 19 6 9; ties in row order
    grouped = batch.take(order)
    torch.testing.assert_close(grouped.completion_ids[1], batch.completion_ids[3])
    torch.testing.assert_close(grouped.loss_mask[1], batch.loss_mask[3])

    def padded(rows: RolloutBatch) -> int:
        return sum(
            part.prompt_ids.numel() + part.completion_ids.numel() for part in micro_batches(rows, settings)
        )

    assert padded(grouped) < padded(batch)


def test_a_registered_loss_type_trains_through_the_learner():
    """The plugin's loss is twice dapo's, so with SGD its update is twice dapo's."""
    dapo, _ = _ragged_update(_settings(micro_batch_size=2, temperature=0.9))
    with scaled_loss() as name:
        settings = _settings(micro_batch_size=2, temperature=0.9, algorithm=AlgorithmConfig(loss_type=name))
        scaled, metrics = _ragged_update(settings)
    _assert_same_update(scaled, {parameter: 2 * delta for parameter, delta in dapo.items()})
    assert "clip_ratio/region_mean" in metrics


def test_the_state_carries_the_optimizer_schedule_and_entropy_coefficient():
    model = build_tiny_model(VOCAB, seed=0)
    algorithm = AlgorithmConfig(entropy_coef=0.1, use_adaptive_entropy=True, entropy_target=50.0)
    settings = _settings(micro_batch_size=2, temperature=1.0, algorithm=algorithm)
    learner = _learner(Placement.local(model), settings)
    learner.learn(_batch(model, settings), torch.tensor([1.0, -1.0, 0.5, -0.5]))
    state = learner.state_dict()
    assert set(state) == {"optimizer", "scheduler", "entropy_control"}
    restored = _learner(Placement.local(model), settings)
    restored.load_state_dict(state)
    assert restored.entropy_control.coef == learner.entropy_control.coef > 0.1
    assert restored.scheduler.state_dict()["last_epoch"] == 1
    restored.load_state_dict({**state, "entropy_control": None})  # a checkpoint from before the bonus
    assert restored.entropy_control.coef == learner.entropy_control.coef


def test_a_checkpoints_optimizer_of_other_parameter_groups_is_refused_with_the_fix():
    """A run resumed with another expert_model_parallel_size (its experts in a group of their
    own) or other trained parameters: one line naming the fix, not torch's bare mismatch."""
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    split = torch.optim.AdamW([{"params": first.parameters()}, {"params": second.parameters()}])
    whole = torch.optim.AdamW([*first.parameters(), *second.parameters()])
    with pytest.raises(ValueError, match="resume with the settings it was saved with"):
        load_optimizer_state(whole, split.state_dict())
    again = torch.optim.AdamW([{"params": first.parameters()}, {"params": second.parameters()}])
    load_optimizer_state(again, split.state_dict())
    assert len(again.param_groups) == 2


def _shared_prompt_update(settings: UpdateSettings, attention: str) -> dict:
    """`_ragged_update`'s parameter change with rows 0-2 and 3-4 sharing their prompts, every
    model attending with `attention`."""
    varlen_attention.register()
    models = [build_tiny_model(VOCAB, seed=seed) for seed in (0, 1)]
    for model in models:
        model.set_attn_implementation(attention)
    model = models[0]
    batch = _ragged_batch(model, _settings(micro_batch_size=6, temperature=0.9))
    for rows in (slice(0, 3), slice(3, 5)):
        batch.prompt_ids[rows], batch.prompt_mask[rows] = (
            batch.prompt_ids[rows][:1],
            batch.prompt_mask[rows][:1],
        )
    learner = _learner(Placement.local(model), settings, Placement.local(models[1]))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    learner.learn(batch, RAGGED_ADVANTAGES)
    return {name: p.detach() - before[name] for name, p in model.named_parameters()}


def test_shared_prompts_update_as_the_padded_micro_batches_do():
    """Old-policy (num_iterations 2), reference (beta) and trained log-probs, each group's prompt
    once, update as the packed rows do (which update as the padded ones: the test above; on this
    batch both are 1.06e-4 of a norm weight's change from the padded update, 9e-6 from each other);
    a model attending otherwise (sdpa) keeps the padded rows."""
    algorithm = AlgorithmConfig(loss_type="dapo", num_iterations=2, beta=0.05)
    common = dict(micro_batch_size=3, temperature=0.9, algorithm=algorithm)
    packed = _shared_prompt_update(_settings(**common, padding_free=True), varlen_attention.NAME)
    shared = _shared_prompt_update(_settings(**common, shared_prompts=True), varlen_attention.NAME)
    _assert_same_update(shared, packed)
    padded = _shared_prompt_update(_settings(**common), "sdpa")
    unshared = _shared_prompt_update(_settings(**common, shared_prompts=True), "sdpa")
    _assert_same_update(unshared, padded)
