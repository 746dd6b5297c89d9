"""Parity with TRL 1.16's GRPOTrainer, driven through its own methods on a tiny local model.

Advantages: `_generate_and_score_completions` runs TRL's real generation and scoring on a batch
whose rewards come from dataset columns, so the rewards are fixed while everything else is TRL's.
Losses: `_compute_loss` on hand-built inputs, against `policy_loss` on `sequence_logprobs` of the
same model. Prompts are unpadded: TRL's loss forward numbers positions 0..seq-1 regardless of left
padding, while `sequence_logprobs` numbers them from the attention mask.
"""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from grpoflow.algo import (
    LOSS_TYPES,
    AdaptiveEntropy,
    BatchTotals,
    LogprobOptions,
    LossSettings,
    combine_rewards,
    entropy_bonus,
    group_advantages,
    high_entropy_mask,
    micro_batch_scale,
    normalize_then_sum_advantages,
    off_policy_mask,
    policy_loss,
    sequence_logprobs,
)

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

NAN = float("nan")
NUM_GENERATIONS = 3
REWARD_WEIGHTS = [1.0, 0.5]
# (batch, num_funcs): a group with spread, one without (after NaNs), one with a missing sample, one mixed
REWARDS = torch.tensor(
    [
        [1.0, 0.0], [0.0, 1.0], [1.0, 1.0],
        [1.0, NAN], [NAN, 2.0], [NAN, NAN],
        [0.3, 0.2], [2.0, NAN], [-1.0, 4.0],
        [0.0, 0.0], [NAN, 1.0], [3.0, -2.0],
    ]
)  # fmt: skip


def first_reward(completions, r0, **_):
    return r0


def second_reward(completions, r1, **_):
    return r1


def build_trainer(tmp_path, checkpoint, num_generations=NUM_GENERATIONS, **config):
    prompts = ["ab", "cd", "ef", "gh"]
    dataset = datasets.Dataset.from_dict({"prompt": prompts, "r0": [0.0] * 4, "r1": [0.0] * 4})
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        bf16=False,  # GRPOConfig defaults to bf16 autocast, even on the CPU; parity is checked in float32
        num_generations=num_generations,
        **config,
    )
    return trl.GRPOTrainer(
        model=str(checkpoint), reward_funcs=[first_reward, second_reward], args=args, train_dataset=dataset
    )


def as_optional(value: float) -> float | None:
    return None if value != value else value


def trl_scored(trainer) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's advantages and logged metrics for the rows of REWARDS."""
    trainer.model.train()
    inputs = [
        {"prompt": f"prompt {row // NUM_GENERATIONS}", "r0": as_optional(r0), "r1": as_optional(r1)}
        for row, (r0, r1) in enumerate(REWARDS.tolist())
    ]
    advantages = trainer._generate_and_score_completions(inputs)["advantages"]
    return advantages, {name: values[-1] for name, values in trainer._metrics["train"].items()}


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_match_trl(tmp_path, tiny_checkpoint, scale_rewards):
    trainer = build_trainer(
        tmp_path,
        tiny_checkpoint,
        per_device_train_batch_size=len(REWARDS),
        max_completion_length=3,
        reward_weights=REWARD_WEIGHTS,
        scale_rewards=scale_rewards,
    )
    trl_advantages, trl_metrics = trl_scored(trainer)

    advantages, metrics = group_advantages(
        combine_rewards(REWARDS, torch.tensor(REWARD_WEIGHTS)), NUM_GENERATIONS, scale_rewards
    )
    torch.testing.assert_close(advantages, trl_advantages, rtol=1e-5, atol=1e-5)
    assert metrics["reward"].item() == pytest.approx(trl_metrics["reward"], abs=1e-5)
    assert metrics["reward_std"].item() == pytest.approx(trl_metrics["reward_std"], abs=1e-5)
    if scale_rewards != "batch":  # TRL's "batch" mode reports whether the *batch* std is zero
        assert metrics["frac_reward_zero_std"].item() == pytest.approx(trl_metrics["frac_reward_zero_std"])


def test_normalize_then_sum_matches_trl(tmp_path, tiny_checkpoint):
    trainer = build_trainer(
        tmp_path,
        tiny_checkpoint,
        per_device_train_batch_size=len(REWARDS),
        max_completion_length=3,
        reward_weights=REWARD_WEIGHTS,
        multi_objective_aggregation="normalize_then_sum",
    )
    trl_advantages, trl_metrics = trl_scored(trainer)

    advantages, metrics = normalize_then_sum_advantages(
        REWARDS, torch.tensor(REWARD_WEIGHTS), NUM_GENERATIONS
    )
    torch.testing.assert_close(advantages, trl_advantages, rtol=1e-5, atol=1e-5)
    for name in ("reward", "reward_std", "frac_reward_zero_std"):
        assert metrics[name].item() == pytest.approx(trl_metrics[name], abs=1e-5), name


LOSS_CASES = {
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "dapo-kl-temperature": dict(loss_type="dapo", beta=0.05, temperature=0.7),
    "grpo-kl": dict(loss_type="grpo", beta=0.05),
    "grpo-plain-kl": dict(loss_type="grpo", beta=0.05, use_bias_correction_kl=False),
    "bnpo": dict(loss_type="bnpo", epsilon_high=0.28),
    "dr_grpo-kl": dict(loss_type="dr_grpo", beta=0.05, max_completion_length=8),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.05, epsilon_high=0.08),
    "gspo-dapo-kl": dict(loss_type="dapo", importance_sampling_level="sequence", beta=0.05, epsilon=0.05),
    "dapo-delta": dict(loss_type="dapo", delta=1.25),
    "dapo-is-weights": dict(loss_type="dapo", beta=0.05),
    "cispo": dict(loss_type="cispo", epsilon_high=1.5),
    "cispo-kl": dict(loss_type="cispo", beta=0.05, epsilon_high=1.5),
    "sapo": dict(loss_type="sapo"),
    "sapo-kl-temperatures": dict(
        loss_type="sapo", beta=0.05, sapo_temperature_pos=0.8, sapo_temperature_neg=2.0
    ),
    "luspo-kl": dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.05, epsilon=0.05),
    "vespo": dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5),
    "vespo-is-weights": dict(loss_type="vespo", beta=0.05),
    "dapo-entropy-bonus": dict(loss_type="dapo", entropy_coef=0.05),
    "grpo-top-entropy-bonus": dict(loss_type="grpo", top_entropy_quantile=0.4, entropy_coef=0.1),
    "sapo-off-policy-mask": dict(loss_type="sapo", off_policy_mask_threshold=0.1),
    "dapo-off-policy-mask-top-entropy-kl": dict(
        loss_type="dapo", off_policy_mask_threshold=0.05, top_entropy_quantile=0.5, beta=0.05
    ),
}
BATCH, PROMPT_LENGTH, COMPLETION_LENGTHS = 4, 4, [6, 4, 1, 5]


def loss_inputs(model, temperature, with_ref, with_is_weights, num_micro_batches):
    """A micro-batch as `_generate_and_score_completions` would hand it to `_compute_loss`."""
    generator = torch.Generator().manual_seed(0)
    width = max(COMPLETION_LENGTHS)
    prompt_ids = torch.randint(2, model.config.vocab_size, (BATCH, PROMPT_LENGTH), generator=generator)
    completion_mask = (torch.arange(width) < torch.tensor(COMPLETION_LENGTHS).unsqueeze(1)).long()
    completion_ids = torch.randint(2, model.config.vocab_size, (BATCH, width), generator=generator)
    completion_ids = completion_ids * completion_mask  # right padding with pad id 0
    with torch.no_grad():
        logps, _ = sequence_logprobs(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([torch.ones_like(prompt_ids), completion_mask], dim=1),
            width,
            LogprobOptions(temperature=temperature),
        )
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(BATCH, generator=generator),
        # the generation batch holds `num_micro_batches` micro-batches, each with this many tokens
        "num_items_in_batch": completion_mask.sum() * num_micro_batches,
        "old_per_token_logps": logps + 0.5 * torch.randn(logps.shape, generator=generator),
    }
    if with_ref:
        inputs["ref_per_token_logps"] = logps + 0.5 * torch.randn(logps.shape, generator=generator)
    if with_is_weights:
        inputs["importance_sampling_ratio"] = 0.5 + torch.rand(logps.shape, generator=generator)
    return inputs


def gradients(model):
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("num_micro_batches", [1, 2])
@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_loss_and_gradients_match_trl(tmp_path, tiny_checkpoint, case, num_micro_batches):
    config = dict(LOSS_CASES[case])
    trainer = build_trainer(
        tmp_path,
        tiny_checkpoint,
        num_generations=2,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=num_micro_batches,
        **config,
    )
    model = trainer.model
    model.train()
    # Normally set by the training loop; `_compute_loss` divides by it for grpo, bnpo and dr_grpo.
    trainer.current_gradient_accumulation_steps = num_micro_batches
    with_is_weights = case.endswith("is-weights")
    if with_is_weights:
        # `_compute_loss` applies the sampler-mismatch ratio only on its vLLM path; nothing else reads these.
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    inputs = loss_inputs(model, trainer.temperature, trainer.beta != 0, with_is_weights, num_micro_batches)
    if trainer.off_policy_mask_threshold is not None:  # negative advantages, one far off-policy
        inputs["advantages"] = inputs["advantages"] * torch.tensor([1.0, -1.0, -1.0, 1.0])

    trl_loss = trainer._compute_loss(model, inputs)
    trl_loss.backward()
    trl_grads = gradients(model)
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    completion_mask = inputs["completion_mask"]
    args = trainer.args
    logps, entropy = sequence_logprobs(
        model,
        torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
        torch.cat([inputs["prompt_mask"], completion_mask], dim=1),
        completion_mask.size(1),
        LogprobOptions(
            temperature=trainer.temperature,
            chunk_size=5,
            compute_entropy=True,
            entropy_grad=args.entropy_coef != 0,
        ),
    )
    token_mask = torch.ones_like(logps)
    if args.top_entropy_quantile < 1:
        token_mask = high_entropy_mask(entropy, completion_mask, args.top_entropy_quantile)
        assert 0 < (token_mask * completion_mask).sum() < completion_mask.sum()  # some tokens dropped
    loss_weights = token_mask
    if args.off_policy_mask_threshold is not None:
        kept = off_policy_mask(
            inputs["advantages"],
            logps,
            inputs["old_per_token_logps"],
            completion_mask,
            args.off_policy_mask_threshold,
        )
        loss_weights = loss_weights * kept
        assert 0 < kept.sum() < len(kept)  # some completions dropped
    # The loss type's settings have TRL's names: epsilon, epsilon_high, delta, sapo_*, vespo_*.
    settings_class = LOSS_TYPES[trainer.loss_type].settings
    loss, metrics = policy_loss(
        logps,
        inputs["old_per_token_logps"],
        inputs["advantages"],
        completion_mask,
        LossSettings(
            loss_type=trainer.loss_type,
            surrogate_settings=settings_class(
                **{f.name: getattr(args, f.name) for f in fields(settings_class)}
            ),
            importance_sampling_level=trainer.importance_sampling_level,
            beta=trainer.beta,
            kl_bias_correction=args.use_bias_correction_kl,
        ),
        BatchTotals(inputs["num_items_in_batch"], BATCH * num_micro_batches, trainer.max_completion_length),
        ref_logps=inputs.get("ref_per_token_logps"),
        is_weights=inputs.get("importance_sampling_ratio"),
        loss_weights=loss_weights,
    )
    loss = loss * micro_batch_scale(trainer.loss_type, num_micro_batches)
    if args.entropy_coef:
        bonus = entropy_bonus(entropy, completion_mask * token_mask)
        loss = loss - args.entropy_coef * bonus / num_micro_batches
    loss.backward()

    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-5)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    for name, value in metrics.items():
        assert value.item() == pytest.approx(trl_metrics[name], abs=1e-5), name
    mask = completion_mask.float()
    assert ((entropy.detach() * mask).sum() / mask.sum()).item() == pytest.approx(
        trl_metrics["entropy"], abs=1e-5
    )
    # the inputs exercise the clipped branch
    clip_metric = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean"}.get(trainer.loss_type)
    if trainer.loss_type != "sapo":
        assert metrics[clip_metric or "clip_ratio/region_mean"] > 0


def test_adaptive_entropy_matches_trl(tmp_path, tiny_checkpoint):
    config = dict(
        loss_type="dapo",
        entropy_coef=0.1,
        use_adaptive_entropy=True,
        entropy_target=50.0,
        entropy_coef_delta=0.05,
    )
    trainer = build_trainer(
        tmp_path, tiny_checkpoint, num_generations=2, per_device_train_batch_size=BATCH, **config
    )
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = loss_inputs(model, trainer.temperature, False, False, 1)
    args = trainer.args
    control = AdaptiveEntropy(
        coef=args.entropy_coef,
        adaptive=True,
        target=args.entropy_target,
        delta=args.entropy_coef_delta,
        coef_min=args.entropy_coef_min,
        coef_max=args.entropy_coef_max,
    )
    mask = inputs["completion_mask"]
    for _ in range(3):  # no bonus before the first measurement, then a rising coefficient
        trl_loss = trainer._compute_loss(model, inputs)
        trl_loss.backward()
        trl_grads = gradients(model)
        logps, entropy = sequence_logprobs(
            model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], mask], dim=1),
            mask.size(1),
            LogprobOptions(temperature=trainer.temperature, compute_entropy=True, entropy_grad=True),
        )
        loss, _ = policy_loss(
            logps,
            inputs["old_per_token_logps"],
            inputs["advantages"],
            mask,
            totals=BatchTotals(num_items_in_batch=mask.sum()),
        )
        loss = loss - control.applied_coef() * entropy_bonus(entropy, mask)
        loss.backward()
        torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-5)
        for name, grad in gradients(model).items():
            torch.testing.assert_close(grad, trl_grads[name], rtol=1e-5, atol=1e-5, msg=name)
        control.step(entropy_bonus(entropy.detach(), mask).item())
        assert control.coef == pytest.approx(trainer.entropy_coef)
    assert control.coef == pytest.approx(0.25)
