"""Helpers shared by the vLLM tests, colocated and over HTTP: the prompts, greedy rollouts, changed
weights and the transformers reference they are checked against, plain and with LoRA adapters."""

from __future__ import annotations

import copy

import torch

from grpoflow.engines import SamplingParams
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model
from helpers import support

PROMPTS = [[5, 6, 7, 8], [20, 21], [30, 31, 32]]
MAX_TOKENS = 6


def reference_logprobs(model, prompt, completion, temperature):
    """log_softmax(logits / temperature) of each completion token, by a plain transformers forward."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logps = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logps.gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def perturbed(model, scale=0.5, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [
        (name, tensor.detach() + scale * torch.randn(tensor.shape, generator=generator))
        for name, tensor in model.named_parameters()
    ]


def greedy(engine, prompts=PROMPTS, max_tokens=6):
    params = SamplingParams(n=1, max_tokens=max_tokens, temperature=0.0)
    return [group[0] for group in engine.generate(prompts, params)]


def tiny_base():
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    return build_tiny_model(len(tokenizer), **support.VLLM_TINY_SHAPE).eval(), tokenizer


def train_adapters(policy, seed: int) -> None:
    """Stand-in for an optimizer step: new, non-zero adapter weights."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_" in name:
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))


def merged_reference(policy, prompt):
    """Greedy continuation and its log-probs from the policy with its adapters merged (transformers)."""
    merged = copy.deepcopy(policy).merge_and_unload()
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = merged(input_ids=torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt) :], logprobs


def assert_rollouts_match_merged(engine, policy):
    params = SamplingParams(n=1, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, params)):
        tokens, logprobs = merged_reference(policy, prompt)
        assert group[0].token_ids == tokens
        torch.testing.assert_close(torch.tensor(group[0].logprobs), torch.tensor(logprobs), atol=2e-3, rtol=0)
