"""Packed, padding-free log-probs against the padded path, and the token-budget batcher.

Tolerances: float32 throughout; packed and padded forward passes sum the same products in another
order (another attention mask shape, other matmul shapes), so values agree to about 1e-6 and are
compared at rtol=1e-5, atol=1e-5 (gradients at atol=1e-6 relative to their scale).
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.packed_batches import VOCAB, padded_batch

from grpoflow.algo import (
    LOSS_TYPES,
    BatchTotals,
    LogprobOptions,
    LossSettings,
    check_packed_attention,
    pack_sequences,
    packed_sequence_logprobs,
    policy_loss,
    sequence_logprobs,
    token_budget_batches,
    unpack,
)
from grpoflow.policy.tiny import build_tiny_model


def padded_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, **kwargs):
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    return sequence_logprobs(model, ids, mask, logits_to_keep=completion_ids.size(1), **kwargs)


def test_packing_lays_real_tokens_end_to_end_with_restarting_positions():
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_ids = torch.tensor([[10, 11, 0], [12, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    packed = pack_sequences(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert packed.input_ids.tolist() == [[5, 6, 10, 11, 7, 8, 9, 12]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert packed.targets.tolist() == [10, 11, 12]
    assert packed.score_index.tolist() == [1, 2, 6]  # the token before each target
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    out = unpack(values, packed)
    assert out.tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]
    out.sum().backward()
    assert values.grad.tolist() == [1.0, 1.0, 1.0]


def test_packing_refuses_an_empty_prompt():
    with pytest.raises(ValueError, match="prompt token"):
        pack_sequences(torch.tensor([[0]]), torch.tensor([[0]]), torch.tensor([[4]]), torch.tensor([[1]]))


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_log_probs_and_entropy_equal_padded(model_type, attention):
    model = build_tiny_model(VOCAB, model_type=model_type, seed=0).eval()
    model.set_attn_implementation(attention)
    inputs = padded_batch()
    options = LogprobOptions(temperature=0.7, chunk_size=16, compute_entropy=True)
    with torch.no_grad():
        padded, padded_entropy = padded_logprobs(model, *inputs, options=options)
        packed, packed_entropy = packed_sequence_logprobs(model, pack_sequences(*inputs), options)
    mask = inputs[3].bool()
    torch.testing.assert_close(packed[mask], padded[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_entropy[mask], padded_entropy[mask], rtol=1e-5, atol=1e-5)
    assert not packed[~mask].any()


def test_models_scored_through_their_full_forward_pack_too():
    model = build_tiny_model(VOCAB, seed=0).eval()
    model.config.logit_scale = 1.0  # a logit-scaling attribute: no decoder-and-head shortcut
    inputs = padded_batch()
    with torch.no_grad():
        padded, _ = padded_logprobs(model, *inputs)
        packed, _ = packed_sequence_logprobs(model, pack_sequences(*inputs))
    mask = inputs[3].bool()
    torch.testing.assert_close(packed[mask], padded[mask], rtol=1e-5, atol=1e-5)


def _gradients(model, logps_fn, loss_type: str) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    inputs = padded_batch()
    logps, _ = logps_fn(model, inputs)
    mask = inputs[3]
    old = logps.detach() - 0.05 * torch.arange(mask.numel()).view_as(mask).remainder(3)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    loss, _ = policy_loss(
        logps,
        old,
        advantages,
        mask,
        LossSettings(loss_type=loss_type, beta=0.04),
        BatchTotals(max_completion_length=mask.size(1)),
        ref_logps=old + 0.1,
    )
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _padded(model, inputs):
    return padded_logprobs(model, *inputs)


def _packed(model, inputs):
    return packed_sequence_logprobs(model, pack_sequences(*inputs))


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_packed_losses_have_the_padded_gradients(loss_type):
    model = build_tiny_model(VOCAB, seed=0)
    padded = _gradients(model, _padded, loss_type)
    packed = _gradients(model, _packed, loss_type)
    assert padded.keys() == packed.keys() and padded
    for name, grad in padded.items():
        scale = grad.abs().max().clamp(min=1e-3)
        torch.testing.assert_close(packed[name] / scale, grad / scale, rtol=0, atol=1e-5, msg=name)


def test_packed_lora_has_the_padded_log_probs_and_gradients():
    pytest.importorskip("peft")
    from grpoflow.policy.lora import AdapterConfig, add_lora

    model = add_lora(build_tiny_model(VOCAB, seed=0), AdapterConfig(lora_dropout=0.0))
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.2)
    padded = _gradients(model, _padded, "dapo")
    packed = _gradients(model, _packed, "dapo")
    assert padded and all("lora_" in name for name in padded)
    for name, grad in padded.items():
        scale = grad.abs().max().clamp(min=1e-3)
        torch.testing.assert_close(packed[name] / scale, grad / scale, rtol=0, atol=1e-5, msg=name)


def test_packing_is_refused_for_attention_that_would_mix_sequences():
    model = build_tiny_model(VOCAB, seed=0)
    check_packed_attention(model)  # sdpa
    model.config._attn_implementation = "paged|eager"
    with pytest.raises(ValueError, match="padding_free"):
        check_packed_attention(model)
    with pytest.raises(ValueError, match="attn_implementation"):
        check_packed_attention(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("seed", range(20))
def test_token_budget_batches_cover_every_sequence_once_within_the_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
    budget = rng.randint(50, 600)
    batches = token_budget_batches(lengths, budget)
    assert [i for batch in batches for i in batch] == list(range(len(lengths)))
    for batch in batches:
        tokens = sum(lengths[i] for i in batch)
        assert tokens <= budget or len(batch) == 1
    for before, after in zip(batches, batches[1:]):  # greedy: the next sequence did not fit
        assert sum(lengths[i] for i in before) + lengths[after.start] > budget
    wanted = rng.randint(len(batches), len(lengths))
    split = token_budget_batches(lengths, budget, min_batches=wanted)
    assert len(split) == wanted
    assert [i for batch in split for i in batch] == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in batch) <= budget or len(batch) == 1 for batch in split)


def test_a_sequence_over_the_budget_gets_a_micro_batch_of_its_own():
    assert token_budget_batches([3, 10, 2, 2], 5) == [range(0, 1), range(1, 2), range(2, 4)]
    assert token_budget_batches([4, 4, 4, 4], 8, min_batches=3) == [range(0, 1), range(1, 2), range(2, 4)]
    assert token_budget_batches([], 8) == []


def test_token_budget_errors_name_the_argument():
    with pytest.raises(ValueError, match="max_tokens"):
        token_budget_batches([1, 2], 0)
    with pytest.raises(ValueError, match="min_batches"):
        token_budget_batches([1, 2], 4, min_batches=3)
