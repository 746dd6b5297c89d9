"""Per-token log-probabilities of completions, without materialising the full logits.

The vocabulary projection is the memory peak of RL post-training: `(batch * seq, vocab)` float32
logits are gigabytes for a modern vocabulary. Here the last hidden states are projected a chunk of
tokens at a time. With a linear output head, each chunk runs through `_LinearLogProb`, an autograd
function that saves only the hidden chunk and one logsumexp per token, and in the backward pass
recomputes the logits once and turns them into the gradient in place (`d log p_y / d logits =
onehot(y) - softmax`), with no softmax graph kept. On CUDA both passes over the logits run as
Triton kernels that read the bf16 logits once (`logprob_kernels.py`). Other heads are
checkpointed per chunk.

Positions follow the attention mask (`cumsum(mask) - 1`), as `generate` and vLLM number them, so
left padding does not shift the positions of a prompt. `packed_sequence_logprobs` scores the same
tokens from a padding-free row (`packing.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from grpoflow.algo.packing import PackedSequences, unpack
from grpoflow.algo.truncation import Truncation, truncated_scores

DEFAULT_CHUNK_SIZE = 4096
"""Tokens projected to the vocabulary at a time."""

_LOGIT_SCALING_ATTRIBUTES = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)
"""Config fields of models whose forward transforms the logits after the output projection."""


def _check_scoring(temperature: float, chunk_size: int) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")


@dataclass(frozen=True, kw_only=True, slots=True)
class LogprobOptions:
    """How completion tokens are scored: the distribution they are scored under and the memory
    bound of the projection. The same for a padded batch and a packed one."""

    temperature: float = 1.0
    """Divides the logits, as at sampling time; > 0."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Tokens projected to the vocabulary at a time; the float32 logits never exceed
    `(chunk_size, vocab)`, in the forward pass or in backward."""
    compute_entropy: bool = False
    """Also return the entropy of each temperature-scaled (and truncated) distribution."""
    entropy_grad: bool = False
    """The entropy carries a gradient (for an entropy bonus in the loss)."""
    truncation: Truncation | None = None
    """Top-k/top-p/min-p replayed on the scaled logits; None or inactive: the whole vocabulary."""

    def __post_init__(self) -> None:
        _check_scoring(self.temperature, self.chunk_size)


def selective_log_softmax(logits: Tensor, index: Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """`log_softmax(logits)[..., index]`, computed in float32 a chunk of rows at a time.

    Args:
        logits: `(..., vocab)`.
        index: `(...)`, integer ids into the vocabulary.
        chunk_size: rows per chunk; bounds the float32 temporaries to `(chunk_size, vocab)`.

    Returns:
        `(...)` float32 log-probabilities.
    """
    flat_logits = logits.reshape(-1, logits.size(-1))
    flat_index = index.reshape(-1)
    pieces = [
        _gather_log_prob(rows.float(), ids)
        for rows, ids in zip(flat_logits.split(chunk_size), flat_index.split(chunk_size))
    ]
    return _concat(pieces, flat_logits).view(index.shape)


def _gather_log_prob(logits: Tensor, index: Tensor) -> Tensor:
    """`(rows, vocab)`, `(rows,)` -> `(rows,)`: the target logit minus the row's logsumexp."""
    target = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return target - torch.logsumexp(logits, dim=-1)


def _entropy(logits: Tensor, differentiable: bool = False) -> Tensor:
    """`(rows, vocab)` -> `(rows,)` entropy of `softmax(logits)`, with gradient only if asked."""
    with torch.set_grad_enabled(differentiable and torch.is_grad_enabled()):
        log_probs = torch.log_softmax(logits, dim=-1)
        # Tokens outside a truncated support have log p = -inf and p = 0: they add nothing.
        return -(log_probs.exp() * log_probs.masked_fill(log_probs == -torch.inf, 0)).sum(dim=-1)


def _concat(pieces: list[Tensor], like: Tensor) -> Tensor:
    return torch.cat(pieces) if pieces else like.new_zeros(0, dtype=torch.float32)


def _linear_parameters(lm_head: nn.Linear | Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    if isinstance(lm_head, nn.Linear):
        if bias is not None:
            raise ValueError("Pass `bias` only with a weight tensor; an nn.Linear lm_head carries its own.")
        return lm_head.weight, lm_head.bias
    return lm_head, bias


def head_product(lm_head: nn.Module | Tensor) -> Callable[..., Tensor] | None:
    """The product `(hidden, weight, bias) -> logits` the fused path may compute a head's logits
    with: `F.linear` for a weight tensor or an `nn.Linear` computing it, the head's own
    `linear_product` when its forward was set on the instance with one (as
    `grpoflow.policy.batch_invariant` does), else None (the module's forward, chunk by chunk)."""
    if isinstance(lm_head, Tensor):
        return F.linear
    if not isinstance(lm_head, nn.Linear):
        return None
    if "forward" not in vars(lm_head):
        return F.linear
    return vars(lm_head).get("linear_product")


def projection(lm_head: nn.Module | Tensor, bias: Tensor | None):
    """A callable `hidden (tokens, hidden) -> logits (tokens, vocab)` and the weight it uses."""
    if isinstance(lm_head, nn.Module):
        if bias is not None:
            raise ValueError("Pass `bias` only with a weight tensor; an nn.Module lm_head carries its own.")
        return lm_head, lm_head.weight
    return (lambda hidden: F.linear(hidden, lm_head, bias)), lm_head


def token_logprobs_from_hidden(
    hidden: Tensor,
    lm_head: nn.Module | Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    compute_entropy: bool = False,
    bias: Tensor | None = None,
    entropy_grad: bool = False,
    truncation: Truncation | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of `targets` under `softmax(lm_head(hidden) / temperature)`, or under it
    renormalised over the tokens that `truncation` keeps (each target kept).

    Args:
        hidden: `(batch, seq, hidden)` last hidden states; position t predicts `targets[:, t]`.
        lm_head: the output projection, an `nn.Module` or its weight `(vocab, hidden)`.
        targets: `(batch, seq)` token ids.
        temperature, chunk_size, compute_entropy, entropy_grad, truncation: as the fields of
            `LogprobOptions`.
        bias: `(vocab,)`, only with a weight tensor.

    Returns:
        log_probs: `(batch, seq)` float32.
        entropy: `(batch, seq)` float32, without gradient unless `entropy_grad`, or None.
    """
    _check_scoring(temperature, chunk_size)
    truncation = truncation if truncation is not None and truncation.active else None
    product = head_product(lm_head)
    if product is not None and truncation is None:
        weight, bias = _linear_parameters(lm_head, bias)
        flat_hidden = hidden.reshape(-1, hidden.size(-1))
        pieces = [
            _LinearLogProb.apply(
                hidden_chunk, weight, bias, target_chunk, temperature, compute_entropy, entropy_grad, product
            )
            for hidden_chunk, target_chunk in zip(
                flat_hidden.split(chunk_size), targets.reshape(-1).split(chunk_size)
            )
        ]
        log_probs = _concat([piece[0] for piece in pieces], flat_hidden).view(targets.shape)
        entropy = (
            _concat([piece[1] for piece in pieces], flat_hidden).view(targets.shape)
            if compute_entropy
            else None
        )
        return log_probs, entropy
    project, weight = projection(lm_head, bias)

    def score_chunk(hidden_chunk: Tensor, target_chunk: Tensor) -> tuple[Tensor, Tensor | None]:
        logits = truncated_scores(project(hidden_chunk).float() / temperature, truncation, target_chunk)
        entropy = _entropy(logits, entropy_grad) if compute_entropy else None
        return _gather_log_prob(logits, target_chunk), entropy

    recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    flat_hidden = hidden.reshape(-1, hidden.size(-1))
    log_probs, entropies = [], []
    for hidden_chunk, target_chunk in zip(
        flat_hidden.split(chunk_size), targets.reshape(-1).split(chunk_size)
    ):
        if recompute:
            chunk_log_probs, chunk_entropy = checkpoint(
                score_chunk, hidden_chunk, target_chunk, use_reentrant=False
            )
        else:
            chunk_log_probs, chunk_entropy = score_chunk(hidden_chunk, target_chunk)
        log_probs.append(chunk_log_probs)
        entropies.append(chunk_entropy)
    log_probs = _concat(log_probs, flat_hidden).view(targets.shape)
    entropy = _concat(entropies, flat_hidden).view(targets.shape) if compute_entropy else None
    return log_probs, entropy


class _LinearLogProb(torch.autograd.Function):
    """`log_softmax(hidden @ weight.T + bias) / T)[target]` for one chunk of tokens, in float32.

    Saves the hidden chunk and the per-token logsumexp; the backward pass recomputes the logits
    once (with `F.linear` whatever `product` gave the forward's) and overwrites them with the
    gradient. Entropy (optional) carries a gradient only under
    `entropy_grad`: `dH/dz = -p * (log p + H)` for the scaled logits `z`, added in the eager path.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temperature, compute_entropy, entropy_grad=False, product=F.linear
    ):
        ctx.set_materialize_grads(False)
        logits = product(hidden, weight, bias)  # (chunk, vocab)
        kernels = _fused_kernels(logits)
        if kernels is not None:
            log_probs, logsumexp, entropy = kernels.fused_log_softmax_forward(
                logits, targets, temperature, compute_entropy
            )
        else:
            logits = logits.float().div_(temperature)
            # a batch-invariant head's rows one at a time, as `invariant_token_logprobs` scores them
            log_probs, logsumexp = _eager_log_probs(logits, targets, row_wise=product is not F.linear)
            entropy = None
            if compute_entropy:
                # H = logsumexp - sum(p * logits), p = exp(logits - logsumexp)
                weighted = (logits - logsumexp.unsqueeze(-1)).exp_().mul_(logits).sum(-1)
                entropy = logsumexp - weighted
        if entropy is not None and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, logsumexp, entropy if entropy_grad else None)
        ctx.temperature = temperature
        ctx.product = product
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, targets, logsumexp, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        # the forward's logits again, in cuBLAS: a batch-invariant head's rows (bit-exact in the
        # forward) need only be accurate here, their logsumexp then recomputed from these logits
        grad = F.linear(hidden, weight, bias)
        fused = _fused_kernels(grad)
        if ctx.product is not F.linear:
            if fused is not None:
                logsumexp = fused.fused_log_softmax_forward(grad, targets, temperature, False)[1]
            else:
                logsumexp = torch.logsumexp(grad.float() / temperature, dim=-1)
        if grad_log_probs is None:
            grad_log_probs = logsumexp.new_zeros(logsumexp.shape)
        kernels = fused if grad_entropy is None else None
        if kernels is not None:
            kernels.fused_log_softmax_backward_(grad, targets, logsumexp, grad_log_probs, temperature)
        else:
            grad = grad.float().div_(temperature).sub_(logsumexp.unsqueeze(-1))  # log p
            probs = grad.exp()
            if grad_entropy is not None:  # -p * (log p + H) * dL/dH
                grad.add_(entropy.unsqueeze(-1)).mul_(probs).mul_(-grad_entropy.unsqueeze(-1))
            else:
                grad.zero_()
            grad.sub_(probs.mul_(grad_log_probs.unsqueeze(-1)))
            grad.scatter_add_(-1, targets.unsqueeze(-1), grad_log_probs.unsqueeze(-1))
            grad = grad.div_(temperature).to(hidden.dtype)
        # grad: d loss / d (hidden @ weight.T + bias), (chunk, vocab)
        grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def invariant_token_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """`(rows, vocab)` logits and `(rows,)` targets -> `(rows,)` float32 log-probs of the targets
    under softmax(logits / temperature), bit for bit those the fused path gives a head that
    brings its own product (a batch-invariant head, `head_product`) for the same logits: the
    Triton kernel on CUDA, torch a row at a time elsewhere, so that each row's value is the same
    whatever other rows share the call. The native engine's batch-invariant forward scores its
    draws with it."""
    kernels = _fused_kernels(logits)
    if kernels is not None:
        return kernels.fused_log_softmax_forward(logits, targets, temperature, False)[0]
    return _eager_log_probs(logits.float() / temperature, targets, row_wise=True)[0]


def _eager_log_probs(scaled: Tensor, targets: Tensor, row_wise: bool) -> tuple[Tensor, Tensor]:
    """`(rows, vocab)` float32 logits already divided by the temperature -> the targets' log-probs
    and each row's logsumexp; `row_wise`: `torch.logsumexp` of each row on its own (a reduction
    over many rows may split a row), so that a row's values do not depend on the others."""
    if not row_wise:
        logsumexp = torch.logsumexp(scaled, dim=-1)
    elif scaled.shape[0]:
        logsumexp = torch.stack([torch.logsumexp(row, dim=-1) for row in scaled])
    else:
        logsumexp = scaled.new_zeros(0)
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logsumexp, logsumexp


FUSED_LOG_SOFTMAX = True
"""Use the Triton log-softmax kernels on CUDA (False: the eager float32 path everywhere)."""


def _fused_kernels(logits: Tensor):
    """The Triton log-softmax kernels when `logits` live on CUDA and Triton imports, else None."""
    if not (FUSED_LOG_SOFTMAX and logits.is_cuda and logits.stride(-1) == 1):
        return None
    return _load_kernels()


@functools.cache
def _load_kernels():
    try:
        from grpoflow.algo import logprob_kernels
    except ImportError:  # no Triton: the eager path
        return None
    return logprob_kernels


def _logprobs_from_hidden(
    hidden: Tensor, head: nn.Module, targets: Tensor, options: LogprobOptions
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs_from_hidden` under `options`."""
    return token_logprobs_from_hidden(
        hidden,
        head,
        targets,
        temperature=options.temperature,
        chunk_size=options.chunk_size,
        compute_entropy=options.compute_entropy,
        entropy_grad=options.entropy_grad,
        truncation=options.truncation,
    )


def _logprobs_from_logits(
    logits: Tensor, targets: Tensor, options: LogprobOptions
) -> tuple[Tensor, Tensor | None]:
    """Like `token_logprobs_from_hidden` for logits a model already produced: `(b, s, vocab)`."""
    flat_logits = logits.reshape(-1, logits.size(-1))
    chunk_size = options.chunk_size
    log_probs, entropies = [], []
    for rows, ids in zip(flat_logits.split(chunk_size), targets.reshape(-1).split(chunk_size)):
        scaled = truncated_scores(rows.float() / options.temperature, options.truncation, ids)
        log_probs.append(_gather_log_prob(scaled, ids))
        if options.compute_entropy:
            entropies.append(_entropy(scaled, options.entropy_grad))
    log_probs = _concat(log_probs, flat_logits).view(targets.shape)
    entropy = _concat(entropies, flat_logits).view(targets.shape) if options.compute_entropy else None
    return log_probs, entropy


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """`(batch, seq)` -> `(batch, seq)` positions counting only attended tokens; padding gets 0."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The model's decoder body and output projection, or None when logits need the full forward."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if any(getattr(config, name, None) is not None for name in _LOGIT_SCALING_ATTRIBUTES):
        return None
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or decoder is model or head is None:
        return None
    return decoder, head


def check_logits_to_keep(logits_to_keep: int, input_ids: Tensor) -> None:
    """Every scored token needs a predecessor in its row: 1 <= logits_to_keep <= seq - 1."""
    if not 0 < logits_to_keep < input_ids.size(1):
        raise ValueError(
            f"logits_to_keep must be in [1, seq - 1] so that every scored token has a predecessor; got "
            f"{logits_to_keep} for seq {input_ids.size(1)}."
        )


def positions(attention_mask: Tensor | None) -> Tensor | None:
    """`(batch, seq)` position ids counted over attended tokens; None without a mask (the model's
    own 0.., which transformers takes without checking them for packed sequences: that check
    waits for the device)."""
    return None if attention_mask is None else position_ids_from_mask(attention_mask)


def completion_hidden(
    decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, logits_to_keep: int
) -> Tensor:
    """`(batch, logits_to_keep, hidden)`: the decoder body's last hidden states that predict the last
    `logits_to_keep` tokens of each row (the state at position t - 1 scores token t)."""
    check_logits_to_keep(logits_to_keep, input_ids)
    outputs = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions(attention_mask),
        use_cache=False,
    )
    return outputs.last_hidden_state[:, -(logits_to_keep + 1) : -1]


def sequence_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    logits_to_keep: int,
    options: LogprobOptions = LogprobOptions(),
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of the last `logits_to_keep` tokens of each sequence.

    Runs the model's decoder body and projects only the hidden states that predict completion
    tokens (the state at position t - 1 scores token t), in chunks. Models whose forward changes
    the logits after the projection (soft-capping, logit scaling) or that expose no decoder go
    through `model(...)` instead and only the log-softmax is chunked.

    Args:
        model: a causal LM (transformers `PreTrainedModel` or alike).
        input_ids: `(batch, seq)` prompt then completion tokens, prompts left-padded.
        attention_mask: `(batch, seq)`, 1 on real tokens; None when no row has padding before
            a scored token (right padding only), which lets attention run on its causal fast path.
        logits_to_keep: number of completion tokens at the end of each row to score.
        options: how the tokens are scored (temperature, chunking, entropy, truncation).

    Returns:
        log_probs: `(batch, logits_to_keep)` float32.
        entropy: `(batch, logits_to_keep)` float32, with gradient only under `options.entropy_grad`, or None.
    """
    targets = input_ids[:, -logits_to_keep:]
    parts = decoder_and_head(model)
    if parts is None:
        check_logits_to_keep(logits_to_keep, input_ids)
        outputs = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions(attention_mask),
            logits_to_keep=logits_to_keep + 1,
            use_cache=False,
        )
        logits = outputs.logits[:, -(logits_to_keep + 1) : -1]
        return _logprobs_from_logits(logits, targets, options)
    decoder, head = parts
    hidden = completion_hidden(decoder, input_ids, attention_mask, logits_to_keep)
    return _logprobs_from_hidden(hidden, head, targets, options)


def packed_sequence_logprobs(
    model: nn.Module,
    packed: PackedSequences,
    options: LogprobOptions = LogprobOptions(),
) -> tuple[Tensor, Tensor | None]:
    """`sequence_logprobs` of a packed batch (`packing.pack_sequences`): one forward pass over
    the real tokens only, attention kept within each sequence by its restarting `position_ids`.

    Returns the same `(batch, completion_len)` float32 log-probs (and entropy) as the padded
    path, zeros on padding.
    """
    parts = decoder_and_head(model)
    if parts is None:
        logits = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            **packed.attention_kwargs(),
        ).logits
        log_probs, entropy = _logprobs_from_logits(logits[0, packed.score_index], packed.targets, options)
    else:
        decoder, head = parts
        outputs = decoder(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            **packed.attention_kwargs(),
        )
        hidden = outputs.last_hidden_state[0, packed.score_index]  # (scored, hidden)
        log_probs, entropy = _logprobs_from_hidden(hidden, head, packed.targets, options)
    return unpack(log_probs, packed), (unpack(entropy, packed) if entropy is not None else None)
