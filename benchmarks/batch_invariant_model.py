"""A transformers Qwen2-style model run through the batch-invariant kernels, and a paged-cache
decode of it, for benchmarks/batch_invariance.py.

`use_kernels` installs or removes `grpoflow.policy.batch_invariant.BatchInvariantKernels` (the
model's linear layers, RMSNorms, rotary tables and attention on the kernels). `decode_step` runs
one token per row through the same modules with the keys and values in a paged cache (the native
engine's layout); with the kernels it attends with `decode_attention`, stock with the native
engine's decode-attention kernel (`TritonOps`; `TorchOps` on the CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from grpoflow.kernels import batch_invariant as bi
from grpoflow.kernels import batch_invariant_attention as ba
from grpoflow.kernels.ops import DecodeBatch, TorchOps
from grpoflow.policy.batch_invariant import BatchInvariantKernels

BLOCK_SIZE = 32
_INSTALLED: dict[int, BatchInvariantKernels] = {}


def use_kernels(model: nn.Module, on: bool = True) -> None:
    """Run the model's linear layers, RMSNorms and attention through the kernels (on) or stock."""
    installed = _INSTALLED.pop(id(model), None)
    if installed is not None:
        installed.remove()
    if on:
        _INSTALLED[id(model)] = BatchInvariantKernels.install(model)


@dataclass
class PagedCache:
    """Per layer (num_blocks, Hkv, BLOCK_SIZE, D) keys and values; rows' blocks in shuffled order,
    the last block a scratch one that idle rows write to."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    table: torch.Tensor  # (B, max_blocks) int32
    rope: tuple[torch.Tensor, torch.Tensor]  # (max_len, D) cos and sin in the model dtype

    @classmethod
    def allocate(cls, model: nn.Module, rows: int, max_len: int) -> PagedCache:
        config = model.config
        head_dim = config.hidden_size // config.num_attention_heads
        pages = -(-max_len // BLOCK_SIZE)
        num_blocks = rows * pages + 1
        device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        shape = (num_blocks, config.num_key_value_heads, BLOCK_SIZE, head_dim)
        layers = config.num_hidden_layers
        table = torch.randperm(num_blocks - 1, device=device)[: rows * pages].view(rows, pages).int()
        probe = torch.zeros(1, device=device, dtype=dtype)
        cos, sin = model.model.rotary_emb(probe, torch.arange(max_len, device=device)[None])
        return cls(
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)],
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)],
            table,
            (cos[0], sin[0]),
        )

    def slots(self, positions: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(len(positions), device=positions.device)
        slot = self.table[rows, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
        scratch = (self.keys[0].shape[0] - 1) * BLOCK_SIZE
        return torch.where(active, slot, scratch)


def decode_step(
    model: nn.Module,
    cache: PagedCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    active: torch.Tensor,
    kernels: bool,
) -> torch.Tensor:
    """One new token per row at `positions` (B,) -> (B, vocab) logits; rows not `active` are idle."""
    inner, rows = model.model, len(tokens)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    slots = cache.slots(positions, active)
    context = torch.where(active, positions + 1, 0)
    hidden = inner.embed_tokens(tokens)
    cos, sin = cache.rope[0][positions][:, None], cache.rope[1][positions][:, None]  # (B, 1, D)
    batch = DecodeBatch(*cache.rope, positions, slots, cache.table, context, cache.rope[0].shape[0])
    stock_ops = TorchOps
    if not kernels and hidden.is_cuda:
        from grpoflow.kernels.decoder import TritonOps

        stock_ops = TritonOps
    for index, layer in enumerate(inner.layers):
        attn, residual = layer.self_attn, hidden
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(rows, -1, head_dim)
        k = attn.k_proj(x).view(rows, -1, head_dim)
        v = attn.v_proj(x).view(rows, -1, head_dim)
        k_cache, v_cache = cache.keys[index], cache.values[index]
        if kernels:
            q, k = apply_rotary_pos_emb(q[:, :, None], k[:, :, None], cos, sin)
            blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
            k_cache[blocks, :, offsets] = k[:, :, 0]
            v_cache[blocks, :, offsets] = v
            out = ba.decode_attention(
                q[:, :, 0].contiguous(), k_cache, v_cache, cache.table, context, attn.scaling
            )
        else:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            out = stock_ops.decode_layer_attention(q, k, v, k_cache, v_cache, batch, attn.scaling, 0)
        hidden = residual + attn.o_proj(out.reshape(rows, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(inner.norm(hidden))


def _sequences(model: nn.Module, count: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`count` random sequences of lengths length/4..length, left-padded: ids, padding, positions."""
    device = model.lm_head.weight.device
    generator = torch.Generator().manual_seed(0)
    pad = torch.randint(0, length * 3 // 4, (count,), generator=generator).to(device)
    pad[0] = 0
    ids = torch.randint(3, model.config.vocab_size, (count, length), generator=generator).to(device)
    mask = (torch.arange(length, device=device)[None] >= pad[:, None]).long()
    return ids * mask, pad, (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def _compare(model: nn.Module, count: int, length: int, kernels: bool) -> dict:
    use_kernels(model, kernels)
    ids, pad, positions = _sequences(model, count, length)
    full = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    cache = PagedCache.allocate(model, count, length)
    real = length - pad
    identical, worst, total = 0, 0.0, 0
    for step in range(length):
        active = step < real
        index = (pad + step).clamp(max=length - 1)
        tokens = torch.where(active, ids[torch.arange(count, device=ids.device), index], 0)
        position = torch.where(active, torch.full_like(pad, step), 0)
        logits = decode_step(model, cache, tokens, position, active, kernels)
        rows = active.nonzero()[:, 0]
        expected = full[rows, index[rows]]
        same = (logits[rows] == expected).all(-1)
        identical += int(same.sum())
        total += len(rows)
        worst = max(worst, float((logits[rows].float() - expected.float()).abs().max()))
    return dict(positions=total, identical=identical, max_abs_diff=worst)


def identity_check(model: nn.Module, count: int, length: int) -> dict:
    """Full forward logits against paged decode logits at every real position, kernels and stock."""
    results = {
        "batch-invariant kernels": _compare(model, count, length, True),
        "stock (sdpa, cuBLAS, engine attention)": _compare(model, count, length, False),
    }
    use_kernels(model, False)
    return results


def _train_step(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, kernels: bool) -> None:
    hidden = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    targets = ids.roll(-1, 1).reshape(-1, 1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for chunk, target in zip(hidden.reshape(-1, hidden.shape[-1]).split(4096), targets.split(4096)):
        logits = model.lm_head(chunk)
        log_probs = bi.log_softmax(logits) if kernels else logits.float().log_softmax(-1)
        total = total + log_probs.gather(-1, target).sum()
    total.backward()
    model.zero_grad(set_to_none=True)


def _decode_timer(model: nn.Module, rows: int, context: int, kernels: bool, device: torch.device):
    """A callable replaying one decode step (a CUDA graph on the GPU) at `context` tokens."""
    cache = PagedCache.allocate(model, rows, context + 1)
    tokens = torch.randint(3, model.config.vocab_size, (rows,), device=device)
    positions = torch.full((rows,), context, device=device)
    active = torch.ones(rows, dtype=torch.bool, device=device)

    def step():
        return decode_step(model, cache, tokens, positions, active, kernels)

    if device.type != "cuda":
        return step
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def model_timings(model: nn.Module, args, device: torch.device, timed) -> dict:
    """Forward+backward at the trainer's shape and one decode step, with the kernels and stock."""
    ids = torch.randint(3, model.config.vocab_size, (args.trainer_batch, args.trainer_length), device=device)
    positions = torch.arange(args.trainer_length, device=device)[None].expand_as(ids)
    results = {}
    model.train()
    name = f"forward+backward {args.trainer_batch}x{args.trainer_length}"
    results[name] = {}
    for kernels in (True, False):
        use_kernels(model, kernels)
        key = "kernel_ms" if kernels else "stock_ms"
        step = functools.partial(_train_step, model, ids, positions, kernels)
        results[name][key] = timed(step, args.repeats, device, graph=False)
    model.eval()
    name = f"decode step {args.decode_rows} rows, context {args.decode_context}"
    results[name] = {}
    with torch.no_grad():
        for kernels in (True, False):
            use_kernels(model, kernels)
            replay = _decode_timer(model, args.decode_rows, args.decode_context, kernels, device)
            results[name]["kernel_ms" if kernels else "stock_ms"] = timed(
                replay, args.repeats * 5, device, graph=False
            )
    use_kernels(model, False)
    return results
