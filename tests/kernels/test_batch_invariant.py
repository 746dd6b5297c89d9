"""The batch-invariant kernels: on the CPU through Triton's interpreter (float32; its bfloat16
dot products are wrong) against torch references, with each row's result unchanged by the other
rows; on the GPU (tests marked `gpu`) bit for bit across batch shapes in bfloat16, and the decode
step's attention rows equal to the full forward's.

The interpreter is chosen by an environment variable read when Triton is imported, so each
interpreted check runs in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from grpoflow.kernels import batch_invariant as bi  # noqa: E402
from grpoflow.kernels import batch_invariant_attention as ba  # noqa: E402

ROW_WISE = """
import torch
from grpoflow.kernels import batch_invariant as bi
from grpoflow.kernels.ops import rms_norm_reference

torch.manual_seed(0)
x = torch.randn(150, 80)
strided = torch.randn(80, 150).T  # rows of x laid out with a column stride
weight, bias = torch.randn(96, 80), torch.randn(96)
for inputs in (x, strided):
    out = bi.matmul(inputs, weight, bias)
    torch.testing.assert_close(out, torch.nn.functional.linear(inputs, weight, bias), atol=1e-4, rtol=1e-5)
    for rows in (1, 7, 70):
        assert torch.equal(bi.matmul(inputs[-rows:], weight, bias), out[-rows:]), rows
assert bi.matmul(x[:3, None], weight).shape == (3, 1, 96)
norm_weight = torch.randn(80)
normed = bi.rms_norm(x, norm_weight, 1e-6)
torch.testing.assert_close(normed, rms_norm_reference(x, norm_weight, 1e-6), atol=1e-5, rtol=1e-5)
logits = torch.randn(9, 2500) * 4
log_probs = bi.log_softmax(logits)
torch.testing.assert_close(log_probs, logits.log_softmax(-1), atol=1e-5, rtol=1e-5)
residual = torch.randn(150, 80)
normed_sum, summed = bi.add_rms_norm_forward(x, residual, norm_weight, 1e-6)
assert torch.equal(summed, residual + x)
assert torch.equal(normed_sum, bi.rms_norm_forward(residual + x, norm_weight, 1e-6))
for rows in (1, 4):
    assert torch.equal(bi.rms_norm(x[-rows:], norm_weight, 1e-6), normed[-rows:])
    assert torch.equal(bi.log_softmax(logits[-rows:]), log_probs[-rows:])
print("ok")
"""

BACKWARD = """
import torch
from grpoflow.kernels import batch_invariant as bi
from grpoflow.kernels import batch_invariant_attention as ba
from grpoflow.kernels.ops import rms_norm_reference

torch.manual_seed(0)
def grads(fn, *inputs):
    inputs = [t.clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
    return [t.grad for t in inputs]
x, weight, bias = torch.randn(2, 5, 40), torch.randn(24, 40), torch.randn(24)
pairs = [
    (bi.matmul, torch.nn.functional.linear, (x, weight, bias)),
    (lambda x, w: bi.rms_norm(x, w, 1e-6), lambda x, w: rms_norm_reference(x, w, 1e-6), (x, torch.randn(40))),
    (bi.log_softmax, lambda x: x.log_softmax(-1), (x,)),
]
positions = torch.tensor([[0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6]])
qkv = (torch.randn(2, 4, 7, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16))
pairs.append((lambda *t: ba.attention(*t, positions, 0.25)[:, 3:], lambda *t: ba.attention_reference(*t, positions, 0.25)[:, 3:], qkv))
for kernel, reference, inputs in pairs:
    for got, expected in zip(grads(kernel, *inputs), grads(reference, *inputs)):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
print("ok")
"""

ATTENTION = """
import torch
from grpoflow.kernels import batch_invariant_attention as ba

ba.BLOCK_N = 16  # several key blocks in short sequences
torch.manual_seed(0)
batch, kv_heads, length, dim, block_size = 3, 2, 34, 16, 8
for group in (1, 7):
    q = torch.randn(batch, kv_heads * group, length, dim)
    k, v = torch.randn(2, batch, kv_heads, length, dim).unbind(0)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    mask[2, 26:] = 0  # right padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = ba.attention(q, k, v, positions, dim**-0.5)
    torch.testing.assert_close(out, ba.attention_reference(q, k, v, positions, dim**-0.5), atol=1e-5, rtol=1e-5)
    if group == 7:
        packed = torch.cat((torch.arange(15), torch.arange(19)))[None]  # two sequences in one row
        torch.testing.assert_close(
            ba.attention(q, k, v, packed, 0.3), ba.attention_reference(q, k, v, packed, 0.3), atol=1e-5, rtol=1e-5
        )
    # each row's real tokens in a paged cache (shuffled blocks), decoded one position at a time
    first, real = [0, 5, 0], [34, 29, 26]
    caches = torch.randn(2, 20, kv_heads, block_size, dim)
    table = torch.randperm(20)[: batch * 5].view(batch, 5).int()
    for b in range(batch):
        for j in range(real[b]):
            page, slot = table[b, j // block_size], j % block_size
            caches[:, page, :, slot] = torch.stack((k[b, :, first[b] + j], v[b, :, first[b] + j]))
    for step in (0, 15, 16, 25, 28):
        rows = [b for b in range(batch) if step < real[b]]
        query = torch.stack([q[b, :, first[b] + step] for b in rows])
        context = torch.full((len(rows),), step + 1)
        decoded = ba.decode_attention(query, caches[0], caches[1], table[rows], context, dim**-0.5)
        fused = torch.cat([query, torch.randn_like(query)], dim=-1)[..., :dim]  # a q/k/v projection's view
        strided = ba.decode_attention(fused, caches[0], caches[1], table[rows], context, dim**-0.5)
        assert not fused.is_contiguous() and torch.equal(strided, decoded)
        for row, b in enumerate(rows):
            assert torch.equal(decoded[row], out[b, first[b] + step]), (group, step, b)
    for b in range(batch):  # a prefill after a cached prefix of 10 tokens: several queries per row
        query = q[b, :, first[b] + 10 : first[b] + real[b]].transpose(0, 1)[None]  # read in place
        where = torch.arange(10, real[b])[None]
        prefilled = ba.paged_attention(query, caches[0], caches[1], table[b : b + 1], where, dim**-0.5)
        assert torch.equal(
            ba.paged_attention(query.contiguous(), caches[0], caches[1], table[b : b + 1], where, dim**-0.5),
            prefilled,
        )
        assert torch.equal(prefilled[0], out[b, first[b] + 10 : first[b] + real[b]]), (group, b)
    idle = ba.decode_attention(q[:, :, 0].contiguous(), caches[0], caches[1], table, torch.tensor([0, 1, 2]), 0.25)
    assert (idle[0] == 0).all() and torch.isfinite(idle).all()
print("ok")
"""


def _interpret(source: str, interpreter: bool = True) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpreter else "0"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


INTERPRETED = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernels (the gpu tests below)"
)
"""The interpreter checks are the CPU's stand-in for the compiled ones (Triton 3.6's interpreter
cannot run the row-wise kernels)."""


@INTERPRETED
def test_row_wise_kernels_match_torch_and_keep_rows_across_batch_sizes_interpreted():
    """matmul (with bias, strided rows), RMSNorm and log-softmax against torch; each row the same
    bits computed alone, in a few rows or in many."""
    _interpret(ROW_WISE)


@INTERPRETED
def test_backward_passes_give_torch_gradients_interpreted():
    _interpret(BACKWARD)


@INTERPRETED
def test_decode_attention_rows_equal_the_full_forward_interpreted():
    """Left and right padding, packed sequences, grouped heads (1 and 7 per KV head), keys in a
    paged cache of shuffled blocks: each decoded row, and each query of a prefill after a cached
    prefix (`paged_attention`), is the full forward's row bit for bit."""
    _interpret(ATTENTION)


def test_the_cpu_paths_keep_every_property_of_the_kernels():
    """Without the interpreter CPU tensors take `batch_invariant_cpu`'s torch paths: the same
    checks, rows and queries bit-identical across batch shapes, decode and prefill included."""
    _interpret(ROW_WISE, interpreter=False)
    _interpret(ATTENTION, interpreter=False)


def test_a_forwards_layers_check_its_positions_once(monkeypatch):
    """Every layer passes the same positions: checked (a device sync on the GPU) for the first, the
    check reused while the tensor is unchanged, done again once it changes in place."""
    checks = []
    monkeypatch.setattr(ba, "sequence_starts", lambda p, n: checks.append(n) or torch.zeros_like(p))
    q, kv = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    positions = torch.arange(5)[None]
    first = ba.attention_forward(q, kv, kv, positions, 0.25)
    assert torch.equal(ba.attention_forward(q, kv, kv, positions, 0.25), first) and len(checks) == 1
    positions.add_(0)
    ba.attention_forward(q, kv, kv, positions, 0.25)
    ba.attention_forward(q, kv, kv, positions.clone(), 0.25)
    assert len(checks) == 3


def test_bad_inputs_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="one dtype"):
        bi.matmul(torch.randn(2, 8), torch.randn(4, 8).to(torch.bfloat16))
    with pytest.raises(ValueError, match="weight \\(N, K\\)"):
        bi.matmul(torch.randn(2, 8), torch.randn(4, 6))
    with pytest.raises(ValueError, match="weight of shape"):
        bi.rms_norm(torch.randn(2, 8), torch.randn(6), 1e-6)
    q, kv = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="from the attention mask"):
        ba.attention(q, kv, kv, torch.tensor([[1, 2, 3, 4, 5]]), 0.25)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        ba.attention(torch.randn(1, 3, 5, 16), kv, kv, torch.arange(5)[None], 0.25)


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROW_COUNTS = (1, 7, 512, 4096, 24576)
QWEN2_LINEARS = {
    "qkv": (1152, 896),
    "k/v": (128, 896),
    "o": (896, 896),
    "gate_up": (9728, 896),
    "down": (896, 4864),
}


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("name", list(QWEN2_LINEARS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_rows_are_bit_identical_across_row_counts_gpu(name, with_bias):
    torch.manual_seed(0)
    out_features, in_features = QWEN2_LINEARS[name]
    weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * in_features**-0.5
    bias = torch.randn(out_features, device="cuda", dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(max(ROW_COUNTS), in_features, device="cuda", dtype=torch.bfloat16)
    full = bi.matmul(x, weight, bias)
    reference = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(full.float(), reference, atol=3e-2, rtol=2e-2)
    for rows in ROW_COUNTS:
        for start in (0, max(ROW_COUNTS) - rows):
            assert torch.equal(
                bi.matmul(x[start : start + rows], weight, bias), full[start : start + rows]
            ), rows


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("rows", ROW_COUNTS[:4])
def test_rms_norm_and_log_softmax_rows_are_bit_identical_across_batch_sizes_gpu(rows):
    torch.manual_seed(0)
    x = torch.randn(4096, 896, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(896, device="cuda", dtype=torch.bfloat16)
    normed = bi.rms_norm(x, weight, 1e-6)
    assert torch.equal(bi.rms_norm(x[-rows:], weight, 1e-6), normed[-rows:])
    from grpoflow.kernels.ops import rms_norm_reference

    torch.testing.assert_close(normed, rms_norm_reference(x, weight, 1e-6), atol=2e-2, rtol=2e-2)
    logits = torch.randn(min(rows, 512) + 3, 151936, device="cuda", dtype=torch.bfloat16) * 3
    log_probs = bi.log_softmax(logits)
    assert torch.equal(bi.log_softmax(logits[-1:]), log_probs[-1:])
    assert torch.equal(bi.log_softmax(logits[:2]), log_probs[:2])
    torch.testing.assert_close(log_probs, logits.float().log_softmax(-1), atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_rows_equal_the_full_forward_gpu(dtype):
    """Qwen2-0.5B's heads (14 query, 2 KV, 64 wide), 16 sequences of up to 384 tokens, left-padded,
    against 512-row decode steps in a paged cache of 32-token blocks in shuffled order."""
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim, block_size = 16, 14, 2, 384, 64, 32
    q = torch.randn(batch, heads, length, dim, device="cuda", dtype=dtype)
    k, v = torch.randn(2, batch, kv_heads, length, dim, device="cuda", dtype=dtype).unbind(0)
    pad = torch.randint(0, 100, (batch,), device="cuda")
    mask = (torch.arange(length, device="cuda")[None] >= pad[:, None]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    full = ba.attention(q, k, v, positions, dim**-0.5)
    reference = ba.attention_reference(q, k, v, positions, dim**-0.5)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    real = mask.bool()[:, :, None, None].expand_as(full)
    torch.testing.assert_close(full[real], reference[real], atol=tolerance, rtol=tolerance)
    pages = length // block_size
    table = torch.randperm(batch * pages * 2, device="cuda")[: batch * pages].view(batch, pages).int()
    caches = torch.randn(2, batch * pages * 2, kv_heads, block_size, dim, device="cuda", dtype=dtype)
    for b in range(batch):
        count = length - int(pad[b])
        index = torch.arange(count, device="cuda")
        caches[0, table[b, index // block_size].long(), :, index % block_size] = k[b, :, pad[b] :].transpose(
            0, 1
        )
        caches[1, table[b, index // block_size].long(), :, index % block_size] = v[b, :, pad[b] :].transpose(
            0, 1
        )
    repeats = 512 // batch  # 512 decode rows: each sequence 32 times
    for step in (0, 63, 64, 200, 283):
        rows = torch.arange(batch, device="cuda").repeat(repeats)
        query = q[rows, :, (pad[rows] + step).clamp(max=length - 1)]
        context = torch.where(pad[rows] + step < length, step + 1, 0)
        decoded = ba.decode_attention(
            query.contiguous(), caches[0], caches[1], table[rows], context, dim**-0.5
        )
        for b in range(batch):
            if pad[b] + step < length:
                assert torch.equal(decoded[b], full[b, pad[b] + step]), (step, b)
                assert torch.equal(decoded[b + batch * (repeats - 1)], decoded[b])


BACKWARD_POSITIONS = {
    "left padding": torch.cat((torch.zeros(1, 20, dtype=torch.long), torch.arange(108)[None]), 1).repeat(
        4, 1
    ),
    "packed": torch.cat((torch.arange(50), torch.arange(30), torch.arange(48)))[None].repeat(4, 1),
    "plain": torch.arange(128)[None].repeat(4, 1),
    "right padding held": torch.arange(128).clamp(max=99)[None].repeat(4, 1),  # the masked reference
}


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("layout", list(BACKWARD_POSITIONS))
def test_attention_backward_matches_sdpa_gpu(layout):
    """The backward's varlen flash attention (its reference where positions do not count up) gives
    the masked reference's gradients, also in a checkpoint's recompute."""
    torch.manual_seed(0)
    positions = BACKWARD_POSITIONS[layout]
    inputs = [torch.randn(4, h, 128, 64, device="cuda", dtype=torch.bfloat16) for h in (14, 2, 2)]
    grad = torch.randn(4, 128, 14, 64, device="cuda", dtype=torch.bfloat16)
    results = []
    for fn in (ba.attention, ba.attention_reference, ba.attention_for_gradients):
        leaves = [x.clone().requires_grad_() for x in inputs]
        fn(*leaves, positions.cuda(), 0.125).backward(grad)
        results.append([leaf.grad for leaf in leaves])
    for got, recomputed, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(recomputed, expected, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("rows", [512, 12288])
def test_a_fused_products_columns_are_the_separate_products_gpu(rows):
    """The native engine multiplies q/k/v (and gate/up) as one product; the trainer apart."""
    torch.manual_seed(0)
    x = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16)
    parts = [torch.randn(n, 896, device="cuda", dtype=torch.bfloat16) * 896**-0.5 for n in (896, 128, 128)]
    biases = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in (896, 128, 128)]
    fused = bi.matmul(x, torch.cat(parts), torch.cat(biases))
    assert torch.equal(fused, torch.cat([bi.matmul(x, w, b) for w, b in zip(parts, biases)], -1))


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "cols"), [(1, 896), (7, 64), (5000, 896), (300, 1000)])
def test_rms_norm_backward_kernel_gives_autograds_gradients_gpu(dtype, rows, cols):
    from grpoflow.kernels.ops import rms_norm_reference
    from grpoflow.kernels.rms_norm_backward import rms_norm_backward

    torch.manual_seed(0)
    x = torch.randn(rows, cols, device="cuda", dtype=dtype) * 3
    weight = torch.randn(cols, device="cuda", dtype=dtype)
    grad = torch.randn(rows, cols, device="cuda", dtype=dtype)
    leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
    rms_norm_reference(*leaves, 1e-6).backward(grad)
    got_x, got_weight = rms_norm_backward(x, weight, grad, 1e-6)
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(got_x, leaves[0].grad, **tolerance)
    torch.testing.assert_close(
        got_weight.float(), leaves[1].grad.float(), atol=tolerance["atol"] * rows**0.5, rtol=tolerance["rtol"]
    )
    assert (got_x.dtype, got_weight.dtype) == (dtype, dtype)


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_rotary_forward_gives_eagers_bits_and_its_kernel_eagers_values_gpu(dtype):
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from grpoflow.kernels.recompute import recomputing
    from grpoflow.kernels.rotary import rotary_pos_emb

    torch.manual_seed(0)
    q = torch.randn(4, 300, 14, 64, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.randn(4, 300, 2, 64, device="cuda", dtype=dtype).transpose(1, 2)
    angles = torch.randn(4, 300, 32, device="cuda") * 10
    cos, sin = (torch.cat((f(angles), f(angles)), -1).to(dtype) for f in (torch.cos, torch.sin))
    expected = apply_rotary_pos_emb(q, k, cos, sin)
    with recomputing():
        recomputed = rotary_pos_emb(q, k, cos, sin)
    for got, kernel, eager in zip(rotary_pos_emb(q, k, cos, sin), recomputed, expected):
        assert torch.equal(got, eager)
        torch.testing.assert_close(kernel, eager, atol=2e-2, rtol=1e-2)
    leaves = [t.clone().requires_grad_() for t in (q, k)]
    reference = [t.clone().requires_grad_() for t in (q, k)]
    grads = [torch.randn_like(t) for t in (q, k)]
    torch.autograd.backward(rotary_pos_emb(*leaves, cos, sin), grads)
    torch.autograd.backward(apply_rotary_pos_emb(*reference, cos, sin), grads)
    for got, expected in zip(leaves, reference):
        torch.testing.assert_close(got.grad, expected.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@NEEDS_CUDA
def test_the_fused_residual_norm_and_swiglu_give_eagers_adds_and_the_kernels_rows_gpu():
    """The engine's add-and-norm kernel: eager's add bit for bit and the norm kernel's rows of it;
    the SwiGLU kernel the same bits for a row in any batch, its backward autograd's gradients."""
    import torch.nn.functional as F

    from grpoflow.kernels.swiglu import silu_mul, silu_mul_forward

    torch.manual_seed(0)
    x, residual = (torch.randn(700, 896, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    weight = torch.randn(896, device="cuda", dtype=torch.bfloat16)
    normed, summed = bi.add_rms_norm_forward(x, residual, weight, 1e-6)
    assert torch.equal(summed, residual + x)
    assert torch.equal(normed, bi.rms_norm_forward(residual + x, weight, 1e-6))
    assert torch.equal(bi.add_rms_norm_forward(x[:3], residual[:3], weight, 1e-6)[0], normed[:3])
    gate, up = (torch.randn(4, 300, 4864, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(2))
    out = silu_mul_forward(gate, up)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=2e-2, rtol=1e-2)
    assert torch.equal(silu_mul_forward(gate[1, 5:9], up[1, 5:9]), out[1, 5:9])
    leaves = [t.clone().requires_grad_() for t in (gate, up)]
    reference = [t.clone().requires_grad_() for t in (gate, up)]
    grad = torch.randn_like(gate)
    silu_mul(*leaves).backward(grad)
    (F.silu(reference[0]) * reference[1]).backward(grad)
    for got, expected in zip(leaves, reference):
        torch.testing.assert_close(got.grad, expected.grad, atol=5e-2, rtol=2e-2)
