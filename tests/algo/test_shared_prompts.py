"""Each group's prompt packed once, its completions after it, against the padded forward (CPU: the
per-sequence attention of `grpoflow_varlen`; the CUDA kernel in tests/policy/test_varlen_attention).

Tolerances as in test_packing: float32, the same products summed in another order."""

from __future__ import annotations

import pytest
import torch
from helpers.packed_batches import VOCAB, grouped_batch

from grpoflow.algo import LogprobOptions, packed_sequence_logprobs, sequence_logprobs
from grpoflow.algo.shared_prompts import pack_shared_prompts, prompt_runs
from grpoflow.policy import varlen_attention
from grpoflow.policy.tiny import build_tiny_model


def padded_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, options):
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    return sequence_logprobs(model, ids, mask, completion_ids.size(1), options)


def varlen_model(model_type: str = "qwen2"):
    varlen_attention.register()
    model = build_tiny_model(VOCAB, model_type=model_type, seed=0)
    model.set_attn_implementation(varlen_attention.NAME)
    return model


def test_runs_of_rows_sharing_a_prompt():
    prompt_ids, prompt_mask, *_ = grouped_batch()
    assert prompt_runs(prompt_ids, prompt_mask) == [range(0, 3), range(3, 6), range(6, 7)]
    other_padding = prompt_mask.clone()
    other_padding[4, 2] = 0  # same ids, another prompt
    assert prompt_runs(prompt_ids, other_padding) == [
        range(0, 3),
        range(3, 4),
        range(4, 5),
        range(5, 6),
        range(6, 7),
    ]


def test_each_prompt_is_packed_once_and_each_completion_keys_on_it():
    prompt_ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]])
    completion_ids = torch.tensor([[10, 11], [12, 0], [13, 14]])
    completion_mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    packed = pack_shared_prompts(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert packed.input_ids.tolist() == [[5, 6, 10, 11, 12, 7, 8, 9, 13, 14]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 3, 4]]
    assert packed.targets.tolist() == [10, 11, 12, 13, 14]
    assert packed.score_index.tolist() == [1, 2, 1, 7, 8]  # the shared prompt's last token, twice
    # query sequences: prompt, completion, completion, prompt, completion
    assert packed.cu_seq_lens.tolist() == [0, 2, 4, 5, 8, 10]
    assert packed.cu_seq_lens_k.tolist() == [0, 2, 6, 9, 12, 17]
    assert packed.key_index.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 5, 6, 7, 8, 9]
    assert (packed.max_length, packed.max_length_k) == (3, 5)
    kwargs = packed.attention_kwargs()
    assert kwargs["key_index"] is packed.key_index and kwargs["attention_mask"].dim() == 4


def test_nothing_shared_packs_nothing():
    prompt_ids = torch.tensor([[5, 6], [7, 8]])
    ones = torch.ones(2, 2, dtype=torch.long)
    assert pack_shared_prompts(prompt_ids, ones, prompt_ids, ones) is None
    same = prompt_ids[:1].expand(2, -1)
    assert pack_shared_prompts(same, ones, same, torch.zeros(2, 2, dtype=torch.long)) is None  # no tokens
    with pytest.raises(ValueError, match="prompt token"):
        empty = torch.zeros(2, 2, dtype=torch.long)
        pack_shared_prompts(torch.zeros(2, 2, dtype=torch.long), empty, prompt_ids, ones)


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3"])
def test_log_probs_entropy_and_gradients_equal_padded(model_type):
    model = varlen_model(model_type)
    inputs = grouped_batch()
    options = LogprobOptions(temperature=0.7, chunk_size=16, compute_entropy=True)
    mask = inputs[3].bool()
    padded, padded_entropy = padded_logprobs(model, *inputs, options)
    (padded[mask].sum() + padded_entropy[mask].sum()).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    shared, shared_entropy = packed_sequence_logprobs(model, pack_shared_prompts(*inputs), options)
    (shared[mask].sum() + shared_entropy[mask].sum()).backward()
    torch.testing.assert_close(shared[mask], padded[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared_entropy[mask], padded_entropy[mask], rtol=1e-5, atol=1e-5)
    assert not shared[~mask].any()
    for name, parameter in model.named_parameters():
        scale = expected[name].abs().max().clamp_min(1e-3)
        torch.testing.assert_close(
            parameter.grad / scale, expected[name] / scale, rtol=0, atol=1e-5, msg=name
        )


def test_lora_adapters_under_gradient_checkpointing_train_as_padded():
    """PEFT's LoRA layers and transformers' checkpointing (the layers run again, with the packed
    row's key index, in the backward pass)."""
    from peft import LoraConfig, get_peft_model

    model = varlen_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    )
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # zero at start: give the adapters a part in the forward
            torch.nn.init.normal_(parameter, std=0.1)
    model.train()
    inputs = grouped_batch()
    mask = inputs[3].bool()
    options = LogprobOptions(temperature=0.7)
    padded, _ = padded_logprobs(model, *inputs, options)
    padded[mask].sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    shared, _ = packed_sequence_logprobs(model, pack_shared_prompts(*inputs), options)
    shared[mask].sum().backward()
    torch.testing.assert_close(shared[mask], padded[mask], rtol=1e-5, atol=1e-5)
    assert expected and all("lora_" in name for name in expected)
    for name, parameter in model.named_parameters():
        if name in expected:
            scale = expected[name].abs().max().clamp_min(1e-3)
            torch.testing.assert_close(
                parameter.grad / scale, expected[name] / scale, rtol=0, atol=1e-5, msg=name
            )
