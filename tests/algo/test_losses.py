import math

import pytest
import torch

from grpoflow.algo import (
    BatchTotals,
    ClipSettings,
    LossSettings,
    kl_estimate,
    loss_types,
    micro_batch_scale,
    policy_loss,
)

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
SOFT = dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)
VESPO = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)


def policy_loss_with(
    logps,
    old_logps,
    advantages,
    mask,
    *,
    ref_logps=None,
    is_weights=None,
    epsilon_low=0.2,
    epsilon_high=0.2,
    delta=None,
    max_completion_length=None,
    num_items_in_batch=None,
    num_sequences_in_batch=None,
    **settings,
):
    """`policy_loss` with its settings and batch totals as keywords; the clip range reaches the loss
    types whose settings hold it."""
    clip = ClipSettings(epsilon=epsilon_low, epsilon_high=epsilon_high, delta=delta)
    uses_clip = loss_types.LOSS_TYPES[settings.get("loss_type", "dapo")].settings is ClipSettings
    return policy_loss(
        logps,
        old_logps,
        advantages,
        mask,
        LossSettings(surrogate_settings=clip if uses_clip else None, **settings),
        BatchTotals(num_items_in_batch, num_sequences_in_batch, max_completion_length),
        ref_logps=ref_logps,
        is_weights=is_weights,
    )


def reference_token_loss(loss_type, ratio, advantage, logp, options):
    """One token's surrogate loss, before sampler-mismatch weights and KL."""
    eps_low, eps_high, delta = options["epsilon_low"], options["epsilon_high"], options["delta"]
    if loss_type == "cispo":
        return -min(ratio, eps_high) * advantage * logp
    if loss_type == "sapo":
        tau = SOFT["sapo_temperature_pos"] if advantage > 0 else SOFT["sapo_temperature_neg"]
        return -4 / tau / (1 + math.exp(-tau * (ratio - 1))) * advantage
    clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
    capped = ratio if delta is None else min(ratio, delta)
    return -min(capped * advantage, clipped * advantage)


def reference_vespo_weight(log_ratios, log_is_weights, advantage):
    """VESPO's phi(w) of one sequence, from its tokens' log-ratios and log sampler weights."""
    log_w = sum(min(max(value, -20.0), 20.0) for value in log_ratios)
    log_w += sum(min(max(value, math.log(1e-8)), 20.0) for value in log_is_weights)
    log_w = min(max(log_w, math.log(1e-8)), 20.0)
    sign = "pos" if advantage >= 0 else "neg"
    k, lam = VESPO[f"vespo_k_{sign}"], VESPO[f"vespo_lambda_{sign}"]
    return math.exp(lam) * math.exp(log_w) ** k * math.exp(-lam * math.exp(log_w))


def reference_loss(tensors: dict, options: dict) -> float:
    """Token by token with Python floats, straight from the formulas.

    `tensors` holds nested lists `logps`, `old_logps`, `ref_logps`, `is_weights`, `mask` (batch, seq)
    and `advantages` (batch,); `options` holds `policy_loss_with`'s keyword arguments.
    """
    logps, old_logps, ref_logps = tensors["logps"], tensors["old_logps"], tensors["ref_logps"]
    mask, advantages, is_weights = tensors["mask"], tensors["advantages"], tensors["is_weights"]
    beta, loss_type = options["beta"], options["loss_type"]
    batch, seq = len(mask), len(mask[0])
    per_token = [[0.0] * seq for _ in range(batch)]
    for i in range(batch):
        valid = [t for t in range(seq) if mask[i][t]]
        sequence_log_ratio = sum(logps[i][t] - old_logps[i][t] for t in valid) / max(len(valid), 1)
        phi = reference_vespo_weight(
            [logps[i][t] - old_logps[i][t] for t in valid],
            [math.log(w) for w in is_weights[i]] if options["is_weights"] is not None else [],
            advantages[i],
        )
        for t in range(seq):
            token_log_ratio = logps[i][t] - old_logps[i][t]
            ratio = math.exp(
                sequence_log_ratio if options["importance_sampling_level"] == "sequence" else token_log_ratio
            )
            if loss_type == "vespo":
                loss = -phi * advantages[i] * logps[i][t]
            else:
                loss = reference_token_loss(loss_type, ratio, advantages[i], logps[i][t], options)
                loss *= is_weights[i][t]
            if beta:
                d = ref_logps[i][t] - logps[i][t]
                loss += beta * (math.exp(d) - d - 1) * (ratio if options["kl_bias_correction"] else 1.0)
            per_token[i][t] = loss
    sums = [sum(per_token[i][t] for t in range(seq) if mask[i][t]) for i in range(batch)]
    counts = [sum(row) for row in mask]
    sequence_mean = sum(total / max(count, 1) for total, count in zip(sums, counts)) / batch
    global_token_mean = sum(sums) / options["num_items_in_batch"]
    return {
        "grpo": sequence_mean,
        "sapo": sequence_mean,
        "bnpo": sum(sums) / max(sum(counts), 1),
        "dr_grpo": sum(sums) / (batch * options["max_completion_length"]),
        "dapo": global_token_mean,
        "cispo": global_token_mean,
        "vespo": global_token_mean,
        "luspo": sum(sums) / batch,
    }[loss_type]


def random_inputs(batch=4, seq=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(batch, seq, generator=generator, dtype=torch.float64) * 3
    old_logps = logps + 0.4 * torch.randn(batch, seq, generator=generator, dtype=torch.float64)
    ref_logps = logps + 0.4 * torch.randn(batch, seq, generator=generator, dtype=torch.float64)
    advantages = torch.randn(batch, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([seq, 3, 1, 5])[:batch]
    mask = (torch.arange(seq) < lengths.unsqueeze(1)).long()
    return logps, old_logps, ref_logps, advantages, mask


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(
    ("beta", "delta", "use_is_weights", "kl_bias_correction"),
    [(0.0, None, False, True), (0.1, 1.3, True, True), (0.1, None, False, False)],
)
def test_matches_reference(loss_type, level, beta, delta, use_is_weights, kl_bias_correction):
    logps, old_logps, ref_logps, advantages, mask = random_inputs()
    is_weights = torch.rand(logps.shape, dtype=torch.float64) + 0.5
    options = dict(
        ref_logps=ref_logps,
        beta=beta,
        epsilon_low=0.2,
        epsilon_high=0.28,
        delta=delta,
        loss_type=loss_type,
        importance_sampling_level=level,
        max_completion_length=8,
        num_items_in_batch=20,
        is_weights=is_weights if use_is_weights else None,
        kl_bias_correction=kl_bias_correction,
    )
    loss, metrics = policy_loss_with(logps, old_logps, advantages, mask, **options)
    tensors = dict(logps=logps, old_logps=old_logps, ref_logps=ref_logps, advantages=advantages, mask=mask)
    tensors["is_weights"] = is_weights if use_is_weights else torch.ones_like(logps)
    expected = reference_loss({name: value.tolist() for name, value in tensors.items()}, options)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert ("kl" in metrics) == (beta != 0)
    assert all(not value.requires_grad and value.dim() == 0 for value in metrics.values())


def test_on_policy_gradient_closed_form():
    # Ratio 1, nothing clipped: d loss / d logp[i, t] = -A_i / (|o_i| * batch) for grpo.
    logps = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    advantages = torch.tensor([1.0, -2.0])
    loss, metrics = policy_loss_with(logps, None, advantages, mask, loss_type="grpo")
    loss.backward()
    assert loss.item() == pytest.approx(0.5)  # mean of -A
    expected = torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(logps.grad, expected)
    assert metrics["clip_ratio/region_mean"].item() == 0.0


def test_clip_metrics_hand_computed():
    old_logps = torch.zeros(2, 2)
    log_ratio = torch.log(torch.tensor([[0.5, 1.5], [0.5, 1.5]]))
    mask = torch.ones(2, 2)
    advantages = torch.tensor([-1.0, 1.0])
    _, metrics = policy_loss_with(log_ratio, old_logps, advantages, mask)
    # row 0 (A < 0): ratio 0.5 below 0.8 -> low; row 1 (A > 0): ratio 1.5 above 1.2 -> high
    assert metrics["clip_ratio/low_mean"].item() == pytest.approx(0.25)
    assert metrics["clip_ratio/high_mean"].item() == pytest.approx(0.25)
    assert metrics["clip_ratio/region_mean"].item() == pytest.approx(0.5)


def test_is_weights_scale_the_surrogate_but_not_the_kl():
    logps, old_logps, ref_logps, advantages, mask = random_inputs(seed=2)
    zero_advantages = torch.zeros_like(advantages)
    weights = torch.full_like(logps, 3.0)
    plain, _ = policy_loss_with(logps, old_logps, zero_advantages, mask, ref_logps=ref_logps, beta=0.1)
    weighted, _ = policy_loss_with(
        logps, old_logps, zero_advantages, mask, ref_logps=ref_logps, beta=0.1, is_weights=weights
    )
    torch.testing.assert_close(plain, weighted)
    surrogate, _ = policy_loss_with(logps, old_logps, advantages, mask)
    tripled, _ = policy_loss_with(logps, old_logps, advantages, mask, is_weights=weights)
    torch.testing.assert_close(3 * surrogate, tripled)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_add_up_to_the_full_batch(loss_type):
    logps, old_logps, ref_logps, advantages, _ = random_inputs(seq=6)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    totals = dict(max_completion_length=6, num_items_in_batch=mask.sum(), num_sequences_in_batch=4)
    common = dict(ref_logps=ref_logps, beta=0.05, loss_type=loss_type)
    full, _ = policy_loss_with(logps, old_logps, advantages, mask, **common, **totals)
    accumulated = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        micro_common = dict(common, ref_logps=ref_logps[rows])
        micro, _ = policy_loss_with(
            logps[rows], old_logps[rows], advantages[rows], mask[rows], **micro_common, **totals
        )
        accumulated = accumulated + micro * micro_batch_scale(loss_type, 2)
    if loss_type == "bnpo":  # a mean of micro-batch token means: exact only for equal token counts
        assert mask[:2].sum() == mask[2:].sum()
    torch.testing.assert_close(accumulated, full)


@pytest.mark.parametrize("loss_type", sorted(set(LOSS_TYPES) - {"bnpo"}))
def test_unequal_micro_batches_add_up_to_the_full_batch(loss_type):
    """Token-budget micro-batches hold different numbers of completions: weighted by their share of
    the batch's completions (`micro_batch_scale`'s counts), per-sequence means still add up."""
    logps, old_logps, ref_logps, advantages, _ = random_inputs(seq=6)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    totals = dict(max_completion_length=6, num_items_in_batch=mask.sum(), num_sequences_in_batch=4)
    common = dict(beta=0.05, loss_type=loss_type)
    full, _ = policy_loss_with(logps, old_logps, advantages, mask, ref_logps=ref_logps, **common, **totals)
    accumulated = 0.0
    for rows in (slice(0, 1), slice(1, 4)):
        micro, _ = policy_loss_with(
            logps[rows],
            old_logps[rows],
            advantages[rows],
            mask[rows],
            ref_logps=ref_logps[rows],
            **common,
            **totals,
        )
        size = rows.stop - rows.start
        accumulated = accumulated + micro * micro_batch_scale(loss_type, 2, size, 4)
    torch.testing.assert_close(accumulated, full)


def test_bnpo_averages_its_micro_batches_token_means_as_trl_defines():
    assert micro_batch_scale("bnpo", 4, num_sequences=1, num_sequences_in_batch=16) == 0.25
    assert micro_batch_scale("grpo", 4, num_sequences=1, num_sequences_in_batch=16) == 1 / 16
    assert micro_batch_scale("dapo", 4, num_sequences=1, num_sequences_in_batch=16) == 1.0


def test_errors_name_the_known_choices():
    logps, old_logps, ref_logps, advantages, mask = random_inputs()
    with pytest.raises(
        ValueError, match=r"\['bnpo', 'cispo', 'dapo', 'dr_grpo', 'grpo', 'luspo', 'sapo', 'vespo'\]"
    ):
        policy_loss(logps, old_logps, advantages, mask, LossSettings(loss_type="ppo"))
    with pytest.raises(ValueError, match=r"\['sequence', 'token'\]"):
        policy_loss(logps, old_logps, advantages, mask, LossSettings(importance_sampling_level="seq"))
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(logps, old_logps, advantages, mask, LossSettings(beta=0.1))
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logps, old_logps, advantages, mask, LossSettings(loss_type="dr_grpo"))
    with pytest.raises(ValueError, match="known"):
        micro_batch_scale("ppo", 2)


@pytest.mark.parametrize("kl_bias_correction", [True, False])
def test_on_policy_kl_gradient_closed_form(kl_bias_correction):
    # With ratio r = pi / pi_old (value 1 on-policy), d(r * k3)/dlogp = k3 + 1 - exp(ref - logp);
    # plain k3 gives 1 - exp(ref - logp).
    logps = torch.tensor([[-1.0, -0.2]], requires_grad=True)
    ref_logps = torch.tensor([[-0.5, -0.9]])
    loss, metrics = policy_loss_with(
        logps,
        None,
        torch.zeros(1),
        torch.ones(1, 2),
        ref_logps=ref_logps,
        beta=1.0,
        loss_type="bnpo",
        kl_bias_correction=kl_bias_correction,
    )
    loss.backward()
    d = ref_logps - logps.detach()
    k3 = torch.exp(d) - d - 1
    expected = (1 - torch.exp(d) + (k3 if kl_bias_correction else 0)) / 2
    torch.testing.assert_close(logps.grad, expected)
    torch.testing.assert_close(metrics["kl"], k3.mean())


@pytest.mark.parametrize(
    ("loss_type", "normalizer"),
    [("grpo", [6, 2]), ("sapo", [6, 2]), ("cispo", [4, 4]), ("vespo", [4, 4]), ("luspo", [2, 2])],
)
def test_on_policy_gradient_is_the_plain_policy_gradient(loss_type, normalizer):
    # At ratio 1 every surrogate's gradient is -A_i / normalizer: the clip is inactive, CISPO's
    # weight is min(1, epsilon_high) = 1, SAPO's gate has slope 4 * sigmoid'(0) = 1 and VESPO's phi(1) = 1.
    logps = torch.tensor([[-0.3, -1.2, -0.7], [-2.0, -0.1, -0.5]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    advantages = torch.tensor([1.0, -2.0])
    loss, _ = policy_loss_with(logps, None, advantages, mask, loss_type=loss_type, epsilon_high=1.5)
    loss.backward()
    expected = -advantages.unsqueeze(1) / torch.tensor(normalizer).unsqueeze(1) * mask
    torch.testing.assert_close(logps.grad, expected.float())


def test_cispo_weight_is_capped_and_carries_no_gradient():
    old_logps = torch.zeros(1, 2)
    logps = torch.log(torch.tensor([[0.5, 4.0]])).requires_grad_()
    loss, metrics = policy_loss_with(
        logps, old_logps, torch.ones(1), torch.ones(1, 2), loss_type="cispo", epsilon_high=2.0
    )
    loss.backward()
    # weights min(r, 2) = [0.5, 2], detached: d/dlogp = -weight * A / num_tokens
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.25, -1.0]]))
    assert metrics["cispo_clip_ratio"].item() == pytest.approx(0.5)


def test_sapo_gate_fades_away_from_ratio_one():
    old_logps = torch.zeros(1, 3)
    logps = torch.log(torch.tensor([[1.0, 2.0, 6.0]])).requires_grad_()
    loss, _ = policy_loss_with(logps, old_logps, torch.ones(1), torch.ones(1, 3), loss_type="sapo")
    loss.backward()
    # d/dlogp of -4 sigmoid(r - 1) A / 3 is -4 sigmoid'(r - 1) r / 3
    ratio = torch.tensor([1.0, 2.0, 6.0])
    slope = torch.sigmoid(ratio - 1) * (1 - torch.sigmoid(ratio - 1))
    torch.testing.assert_close(logps.grad, (-4 * slope * ratio / 3).unsqueeze(0))
    assert logps.grad[0, 2].abs() < 0.1 < logps.grad[0, 0].abs()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimator_chooses_the_penalty(estimator):
    logps, old_logps, ref_logps, _, mask = random_inputs(seed=3)
    loss, metrics = policy_loss_with(
        logps,
        old_logps,
        torch.zeros(4, dtype=torch.float64),
        mask,
        ref_logps=ref_logps,
        beta=0.5,
        loss_type="bnpo",
        kl_bias_correction=False,
        kl_estimator=estimator,
    )
    expected = (kl_estimate(logps, ref_logps, estimator) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, 0.5 * expected)
    torch.testing.assert_close(metrics["kl"], expected)
