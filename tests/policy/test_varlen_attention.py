"""`attn_implementation: grpoflow_varlen`: packed sequences attended one by one (CPU) or with
torch's varlen flash attention (CUDA) equal the padded batch; anything not packed runs sdpa."""

from __future__ import annotations

import pytest
import torch
from helpers.packed_batches import COMPLETION_LENGTHS, PROMPT_LENGTHS, VOCAB, grouped_batch, padded_batch

from grpoflow.algo import (
    LogprobOptions,
    LossSettings,
    pack_sequences,
    packed_sequence_logprobs,
    policy_loss,
    sequence_logprobs,
)
from grpoflow.algo.shared_prompts import pack_shared_prompts
from grpoflow.policy import varlen_attention
from grpoflow.policy.tiny import build_tiny_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SAMPLING = LogprobOptions(temperature=0.7)


def model_with(attention: str, model_type: str = "qwen2", device="cpu", dtype=torch.float32):
    varlen_attention.register()
    model = build_tiny_model(VOCAB, model_type=model_type, seed=0).to(device=device, dtype=dtype)
    model.set_attn_implementation(attention)
    return model


def padded(model, inputs):
    prompt_ids, prompt_mask, completion_ids, completion_mask = inputs
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    return sequence_logprobs(model, ids, mask, completion_ids.size(1), SAMPLING)[0]


def packed(model, inputs):
    return packed_sequence_logprobs(model, pack_sequences(*inputs), SAMPLING)[0]


def gradients(model, logps_fn, inputs) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logps = logps_fn(model, inputs)
    mask = inputs[3]
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.5, -0.25, 0.75][: mask.shape[0]], device=mask.device)
    loss, _ = policy_loss(logps, logps.detach() - 0.05, advantages, mask, LossSettings(loss_type="dapo"))
    loss.backward()
    return {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3"])
def test_packed_rows_attended_one_sequence_at_a_time_equal_the_padded_batch(model_type, monkeypatch):
    model = model_with(varlen_attention.NAME, model_type)
    calls = []
    attend = varlen_attention.per_sequence_attention
    monkeypatch.setattr(
        varlen_attention,
        "per_sequence_attention",
        lambda *args: calls.append(args[3].tolist()) or attend(*args),
    )
    inputs = padded_batch()
    mask = inputs[3].bool()
    with torch.no_grad():
        torch.testing.assert_close(
            packed(model, inputs)[mask], padded(model, inputs)[mask], rtol=1e-5, atol=1e-5
        )
    lengths = [p + c for p, c in zip(PROMPT_LENGTHS, COMPLETION_LENGTHS)]
    bounds = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert calls == [bounds] * model.config.num_hidden_layers  # packed: every layer; padded: none
    want, got = gradients(model, padded, inputs), gradients(model, packed, inputs)
    for name, grad in want.items():
        scale = grad.abs().max().clamp(min=1e-6)
        torch.testing.assert_close(got[name] / scale, grad / scale, rtol=0, atol=1e-5, msg=name)


def test_what_is_not_packed_runs_sdpa_with_its_masks():
    """A left-padded batch (an attention mask) scores as under sdpa itself, bit for bit."""
    inputs = padded_batch()
    with torch.no_grad():
        got = padded(model_with(varlen_attention.NAME), inputs)
        want = padded(model_with("sdpa"), inputs)
    assert torch.equal(got, want)


def test_per_sequence_attention_keeps_each_sequence_to_itself():
    """Changing one sequence's keys changes no other sequence's output."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(12, h, 8, generator=generator) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    before = varlen_attention.per_sequence_attention(q, k, v, cu, 8**-0.5)
    k[6:] += 1.0
    after = varlen_attention.per_sequence_attention(q, k, v, cu, 8**-0.5)
    assert torch.equal(after[:6], before[:6]) and not torch.equal(after[6:], before[6:])


def adapted(model):
    """`model` with PEFT's LoRA layers (nonzero B: the adapters take part) under gradient
    checkpointing: the layers run again, with the packed row's key index, in the backward pass."""
    from peft import LoraConfig, get_peft_model

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(5)
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    )
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(
                parameter, std=0.1, generator=torch.Generator(parameter.device).manual_seed(7)
            )
    return model.train()


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize(
    "batch, pack, prepare",
    [
        (padded_batch, pack_sequences, None),
        (grouped_batch, pack_shared_prompts, None),
        (grouped_batch, pack_shared_prompts, adapted),
    ],
    ids=["packed", "shared", "shared-lora-checkpointed"],
)
def test_cuda_varlen_flash_attention_equals_the_padded_batch_in_bfloat16(batch, pack, prepare):
    """Packed rows, and completions keyed on their group's prompt (flash attention's causal mask
    aligned to each sequence's last key: a completion's queries are its last tokens)."""
    model, reference = (
        model_with(attention, device="cuda", dtype=torch.bfloat16)
        for attention in (varlen_attention.NAME, "sdpa")
    )
    if prepare is not None:
        model, reference = prepare(model), prepare(reference)
    inputs = batch(device="cuda")
    mask = inputs[3].bool()

    def scored(model, inputs):
        return packed_sequence_logprobs(model, pack(*inputs), SAMPLING)[0]

    torch.testing.assert_close(
        scored(model, inputs)[mask], padded(reference, inputs)[mask], rtol=0, atol=0.05
    )
    want, got = gradients(reference, padded, inputs), gradients(model, scored, inputs)
    assert want and (prepare is None or all("lora_" in name for name in want))
    for name, grad in want.items():
        scale = grad.abs().max().clamp(min=1e-6)
        torch.testing.assert_close(got[name] / scale, grad / scale, rtol=0, atol=0.05, msg=name)
