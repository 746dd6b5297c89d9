import pytest
import torch
from torch import nn

from grpoflow.algo import (
    LogprobOptions,
    position_ids_from_mask,
    selective_log_softmax,
    sequence_logprobs,
    token_logprobs_from_hidden,
)
from grpoflow.policy.tiny import build_tiny_model

VOCAB_SIZE = 52  # the vocabulary of the `tiny_model` fixture


def naive_logprobs(logits, targets, temperature=1.0):
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def naive_entropy(logits, temperature=1.0):
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def naive_sequence_logprobs(model, input_ids, attention_mask, logits_to_keep, temperature):
    """Full logits for every position, then the log-softmax of the completion tokens."""
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    ).logits
    return naive_logprobs(logits[:, -logits_to_keep - 1 : -1], input_ids[:, -logits_to_keep:], temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax_matches_log_softmax(dtype):
    logits = torch.randn(3, 5, 11).to(dtype)
    index = torch.randint(0, 11, (3, 5))
    expected = naive_logprobs(logits, index)
    result = selective_log_softmax(logits, index, chunk_size=4)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, expected)


def test_position_ids_ignore_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


@pytest.mark.parametrize("head_kind", ["module", "weight"])
def test_chunked_values_and_gradients_match_full_logits(head_kind):
    torch.manual_seed(0)
    batch, seq, hidden_size, vocab, temperature = 3, 5, 8, 17, 0.7
    linear = nn.Linear(hidden_size, vocab, bias=True)
    hidden = torch.randn(batch, seq, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, seq))
    upstream = torch.randn(batch, seq)

    full_logits = linear(hidden)
    expected = naive_logprobs(full_logits, targets, temperature)
    (expected * upstream).sum().backward()
    expected_grads = [tensor.grad.clone() for tensor in (hidden, linear.weight, linear.bias)]
    for tensor in (hidden, linear.weight, linear.bias):
        tensor.grad = None

    head = {"module": (linear, None), "weight": (linear.weight, linear.bias)}[head_kind]
    log_probs, entropy = token_logprobs_from_hidden(
        hidden, head[0], targets, temperature, chunk_size=4, compute_entropy=True, bias=head[1]
    )
    (log_probs * upstream).sum().backward()

    torch.testing.assert_close(log_probs, expected)
    torch.testing.assert_close(entropy, naive_entropy(full_logits, temperature))
    assert not entropy.requires_grad
    for tensor, expected_grad in zip((hidden, linear.weight, linear.bias), expected_grads):
        torch.testing.assert_close(tensor.grad, expected_grad)


def saved_vocab_elements(function, vocab):
    """Elements of all tensors with last dimension `vocab` that autograd keeps for backward."""
    sizes = [0]

    def pack(tensor):
        if tensor.dim() and tensor.size(-1) == vocab:
            sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function().sum().backward()
    return sum(sizes)


def test_full_logits_are_never_saved_for_backward():
    batch, seq, hidden_size, vocab, chunk_size = 4, 8, 4, 1000, 8
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    hidden = torch.randn(batch, seq, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, seq))

    def chunked():
        return token_logprobs_from_hidden(hidden, weight, targets, chunk_size=chunk_size)[0]

    def full():
        return naive_logprobs(hidden @ weight.T, targets)

    assert saved_vocab_elements(full, vocab) >= batch * seq * vocab  # the probe sees full logits
    # Checkpointed chunks keep only their hidden states; the logits are recomputed in backward.
    assert saved_vocab_elements(chunked, vocab) < chunk_size * vocab


def test_no_grad_path_matches_and_has_no_graph():
    weight = torch.randn(9, 4)
    hidden = torch.randn(2, 3, 4)
    targets = torch.randint(0, 9, (2, 3))
    with torch.no_grad():
        log_probs, entropy = token_logprobs_from_hidden(hidden, weight, targets, chunk_size=2)
    assert entropy is None and not log_probs.requires_grad
    torch.testing.assert_close(log_probs, naive_logprobs(hidden @ weight.T, targets))


def padded_batch(prompt_lengths, completion_lengths, prompt_width=6, completion_width=5, seed=0):
    """Left-padded prompts followed by right-padded completions, pad id 0."""
    generator = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    for prompt_length, completion_length in zip(prompt_lengths, completion_lengths):
        prompt = torch.randint(2, VOCAB_SIZE, (prompt_length,), generator=generator)
        completion = torch.randint(2, VOCAB_SIZE, (completion_length,), generator=generator)
        left, right = prompt_width - prompt_length, completion_width - completion_length
        rows.append(
            torch.cat(
                [
                    torch.zeros(left, dtype=torch.long),
                    prompt,
                    completion,
                    torch.zeros(right, dtype=torch.long),
                ]
            )
        )
        masks.append(torch.tensor([0] * left + [1] * (prompt_length + completion_length) + [0] * right))
    return torch.stack(rows), torch.stack(masks)


def test_sequence_logprobs_match_full_logits_with_left_padding(tiny_model):
    input_ids, attention_mask = padded_batch([6, 3, 1], [5, 2, 4])
    completion_mask = attention_mask[:, -5:].float()
    options = LogprobOptions(temperature=0.8, chunk_size=4, compute_entropy=True)
    log_probs, entropy = sequence_logprobs(tiny_model, input_ids, attention_mask, 5, options)
    (log_probs * completion_mask).sum().backward()
    grads = {name: param.grad.clone() for name, param in tiny_model.named_parameters()}
    tiny_model.zero_grad()

    expected = naive_sequence_logprobs(tiny_model, input_ids, attention_mask, 5, 0.8)
    (expected * completion_mask).sum().backward()

    torch.testing.assert_close(log_probs * completion_mask, expected * completion_mask)
    assert entropy.shape == log_probs.shape
    for name, param in tiny_model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, msg=name)


def test_left_padding_does_not_change_logprobs(tiny_model):
    input_ids, attention_mask = padded_batch([6, 3], [5, 5], seed=3)
    with torch.no_grad():
        batched, _ = sequence_logprobs(tiny_model, input_ids, attention_mask, 5)
        alone, _ = sequence_logprobs(tiny_model, input_ids[1:, 3:], attention_mask[1:, 3:], 5)
    torch.testing.assert_close(batched[1:], alone)


def test_models_with_logit_softcapping_use_the_full_forward():
    model = build_tiny_model(vocab_size=VOCAB_SIZE, model_type="gemma2")
    assert model.config.final_logit_softcapping is not None
    input_ids, attention_mask = padded_batch([4, 2], [3, 3], completion_width=3)
    with torch.no_grad():
        options = LogprobOptions(temperature=0.9, chunk_size=2)
        log_probs, _ = sequence_logprobs(model, input_ids, attention_mask, 3, options)
        expected = naive_sequence_logprobs(model, input_ids, attention_mask, 3, 0.9)
    torch.testing.assert_close(log_probs, expected)


def test_rejects_logits_to_keep_without_predecessor(tiny_model):
    input_ids, attention_mask = padded_batch([2], [3], prompt_width=2, completion_width=3)
    with pytest.raises(ValueError, match="logits_to_keep"):
        sequence_logprobs(tiny_model, input_ids, attention_mask, 5)


class _Scaled(nn.Module):
    """A head that is not an nn.Linear: the checkpointed path."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear
        self.weight = linear.weight

    def forward(self, hidden):
        return self.linear(hidden)


@pytest.mark.parametrize("head_kind", ["linear", "weight", "module"])
def test_entropy_gradient_matches_full_logits(head_kind):
    torch.manual_seed(0)
    batch, seq, hidden_size, vocab, temperature = 2, 4, 8, 13, 0.8
    linear = nn.Linear(hidden_size, vocab, bias=head_kind != "weight")
    hidden = torch.randn(batch, seq, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, seq))
    up_logp, up_entropy = torch.randn(batch, seq), torch.randn(batch, seq)

    full = linear(hidden)
    expected = (naive_logprobs(full, targets, temperature) * up_logp).sum()
    expected = expected + (naive_entropy(full, temperature) * up_entropy).sum()
    expected_grads = torch.autograd.grad(expected, [hidden, linear.weight])

    head = {"linear": linear, "weight": linear.weight, "module": _Scaled(linear)}[head_kind]
    log_probs, entropy = token_logprobs_from_hidden(
        hidden, head, targets, temperature, chunk_size=3, compute_entropy=True, entropy_grad=True
    )
    grads = torch.autograd.grad(
        (log_probs * up_logp).sum() + (entropy * up_entropy).sum(), [hidden, linear.weight]
    )
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)
    plain, _ = token_logprobs_from_hidden(
        hidden, head, targets, temperature, chunk_size=3, compute_entropy=True
    )
    assert _ is not None and not _.requires_grad


def test_a_batch_invariant_head_takes_the_fused_path_with_the_kernels_product():
    from grpoflow.algo.logprobs import head_product
    from grpoflow.kernels.batch_invariant import matmul_forward
    from grpoflow.policy.batch_invariant import BatchInvariantKernels

    torch.manual_seed(0)
    model = build_tiny_model(vocab_size=40)
    head = model.lm_head
    assert head_product(head) is torch.nn.functional.linear
    kernels = BatchInvariantKernels.install(model)
    assert head_product(head) is matmul_forward
    hidden = torch.randn(2, 5, head.in_features, requires_grad=True)
    targets = torch.randint(0, 40, (2, 5))

    def saved(tensor):
        assert tensor.shape[-1] != 40, "the fused path keeps no logits for backward"
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(saved, lambda tensor: tensor):
        log_probs, _ = token_logprobs_from_hidden(hidden, head, targets, 0.7, chunk_size=4)
    log_probs.sum().backward()
    reference = hidden.detach().clone().requires_grad_()
    expected = naive_logprobs(torch.nn.functional.linear(reference, head.weight.detach()), targets, 0.7)
    expected.sum().backward()
    torch.testing.assert_close(log_probs, expected)
    torch.testing.assert_close(hidden.grad, reference.grad)
    kernels.remove()
    assert head_product(head) is torch.nn.functional.linear


def test_invariant_token_logprobs_are_the_batch_invariant_heads_and_keep_each_row():
    from grpoflow.algo.logprobs import invariant_token_logprobs
    from grpoflow.kernels.batch_invariant import matmul_forward
    from grpoflow.policy.batch_invariant import BatchInvariantKernels

    torch.manual_seed(0)
    model = build_tiny_model(vocab_size=40, dtype=torch.bfloat16)
    BatchInvariantKernels.install(model)
    hidden = torch.randn(3, 5, model.lm_head.in_features, dtype=torch.bfloat16)
    targets = torch.randint(0, 40, (3, 5))
    trained, _ = token_logprobs_from_hidden(hidden, model.lm_head, targets, 0.7, chunk_size=4)
    logits = matmul_forward(hidden.reshape(15, -1), model.lm_head.weight)
    scored = invariant_token_logprobs(logits, targets.reshape(-1), 0.7)
    assert torch.equal(scored.view(3, 5), trained)
    assert torch.equal(invariant_token_logprobs(logits[4:6], targets.reshape(-1)[4:6], 0.7), scored[4:6])
