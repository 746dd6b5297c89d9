"""A checkpointed layer's recompute on torch's fast ops, the forward on the batch-invariant
kernels; the sequences the attention's backward reads. CPU (torch paths of the kernels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from grpoflow.kernels import batch_invariant as bi  # noqa: E402
from grpoflow.kernels import batch_invariant_attention as ba  # noqa: E402
from grpoflow.kernels.recompute import checkpoint_contexts, is_recomputing, recomputing  # noqa: E402


def test_the_recompute_runs_torchs_ops_in_the_kernels_autograd_functions():
    torch.manual_seed(0)
    x, weight, norm = torch.randn(6, 40), torch.randn(24, 40), torch.randn(40)
    q, kv = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert not is_recomputing()
    with recomputing():
        with recomputing():
            assert is_recomputing()
        assert is_recomputing()
        assert torch.equal(bi.matmul(x, weight), F.linear(x, weight))
        assert torch.equal(bi.rms_norm(x, norm, 1e-6), bi.rms_norm_forward(x, norm, 1e-6))  # one kernel
        assert torch.equal(
            ba.attention(q, kv, kv, positions, 0.25), ba.attention_reference(q, kv, kv, positions, 0.25)
        )
        assert bi.matmul(x.requires_grad_(), weight).grad_fn.name().endswith("_MatmulBackward")
    assert not is_recomputing()
    forward, recompute = checkpoint_contexts()
    with forward:
        assert not is_recomputing()
    with recompute:
        assert is_recomputing()


@pytest.mark.parametrize(
    ("positions", "counts_up", "plain", "bounds", "longest"),
    [
        ([[0, 1, 2, 3], [0, 1, 2, 3]], True, True, [0, 4, 8], 4),
        ([[0, 0, 0, 1], [0, 1, 2, 3]], True, False, [0, 1, 2, 4, 8], 4),  # left padding: one-token pads
        ([[0, 1, 0, 1], [0, 1, 2, 0]], True, False, [0, 2, 4, 7, 8], 3),  # packed rows
        ([[0, 1, 2, 2], [0, 1, 2, 3]], False, False, None, None),  # right padding held at its last position
    ],
)
def test_the_rows_sequences_for_the_backward(positions, counts_up, plain, bounds, longest):
    positions = torch.tensor(positions)
    sequences = ba._sequences_of(positions, 2, 4, positions.device)
    assert (sequences.counts_up, sequences.plain) == (counts_up, plain)
    if counts_up:
        assert sequences.bounds.tolist() == bounds and sequences.max_length == longest
    assert ba._sequences_of(positions, 2, 4, positions.device) is sequences  # once per tensor


def test_a_checkpointed_model_on_the_kernels_keeps_its_forward_and_recomputes_on_torch(monkeypatch):
    """With gradient checkpointing as the loader sets it, the forward's logits are the kernels'
    bit for bit; the recompute calls no kernel product, and the gradients are close to those of
    the model without checkpointing."""
    from grpoflow.policy.batch_invariant import BatchInvariantKernels
    from grpoflow.policy.tiny import build_tiny_model

    torch.manual_seed(0)
    model = build_tiny_model(vocab_size=48)
    kernels = BatchInvariantKernels.install(model)
    layer = model.model.layers[0]
    assert "forward" in vars(layer.self_attn) and "forward" in vars(layer.mlp)  # rotary and SwiGLU kernels
    ids = torch.randint(0, 48, (2, 9))
    positions = torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5, 6], list(range(9))])

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logits = model(input_ids=ids, position_ids=positions).logits
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain_logits, plain_grads = run()
    model.gradient_checkpointing_enable({"use_reentrant": False, "context_fn": checkpoint_contexts})
    model.train()
    products = []
    original = bi.matmul_forward
    monkeypatch.setattr(
        bi, "matmul_forward", lambda *a, **k: products.append(is_recomputing()) or original(*a, **k)
    )
    logits, grads = run()
    assert torch.equal(logits, plain_logits)
    assert products and not any(products)  # every kernel product in the forward, none recomputed
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], atol=1e-4, rtol=1e-3, msg=name)
    kernels.remove()
    assert "forward" not in vars(layer.self_attn) and "forward" not in vars(layer.mlp)


ROTARY = """
import torch
from grpoflow.kernels import rotary
from grpoflow.kernels.recompute import recomputing
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

torch.manual_seed(0)
q = torch.randn(2, 5, 4, 16).transpose(1, 2)  # (B, H, L, D), laid out as a projection's view
k = torch.randn(2, 5, 2, 16).transpose(1, 2)
angles = torch.randn(1, 5, 8)
cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
leaves = [t.clone().requires_grad_() for t in (q, k)]
got = rotary.rotary_pos_emb(*leaves, cos, sin)
expected = apply_rotary_pos_emb(q, k, cos, sin)
with recomputing():
    recomputed = rotary.rotary_pos_emb(q, k, cos, sin)
for a, b, c in zip(got, expected, recomputed):
    assert torch.equal(a, b)
    torch.testing.assert_close(c, b, atol=1e-5, rtol=1e-5)
grads = [torch.randn_like(t) for t in got]
torch.autograd.backward(got, grads)
reference = [t.clone().requires_grad_() for t in (q, k)]
torch.autograd.backward(apply_rotary_pos_emb(*reference, cos, sin), grads)
for a, b in zip(leaves, reference):
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
print("ok")
"""


GRADIENT_KERNELS = """
import torch
import torch.nn.functional as F
from grpoflow.kernels import rms_norm_backward as rb, swiglu
from grpoflow.kernels.ops import rms_norm_reference

torch.manual_seed(0)
gate, up, grad = (torch.randn(5, 37) for _ in range(3))
grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
swiglu._silu_mul_backward_kernel[(1,)](gate, up, grad, grad_gate, grad_up, gate.numel(), BLOCK=256)
leaves = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
(F.silu(leaves[0]) * leaves[1]).backward(grad)
torch.testing.assert_close(grad_gate, leaves[0].grad, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(grad_up, leaves[1].grad, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(swiglu.silu_mul_forward(gate, up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)

x, weight, grad = torch.randn(9, 40) * 3, torch.randn(40), torch.randn(9, 40)
grad_x, partial = torch.empty_like(x), torch.empty(4, 40)
rb._rms_norm_backward_kernel[(4,)](x, weight, grad, grad_x, partial, 9, 40, 1e-6, ROWS=3, BLOCK=64)
leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
rms_norm_reference(*leaves, 1e-6).backward(grad)
torch.testing.assert_close(grad_x, leaves[0].grad, atol=1e-4, rtol=1e-4)
torch.testing.assert_close(partial.sum(0), leaves[1].grad, atol=1e-4, rtol=1e-4)
print("ok")
"""


def test_the_kernels_gradients_and_the_rotary_forward_interpreted():
    """Under Triton's interpreter on the CPU: the rotary forward eager's bits, its recompute and
    gradients (the kernel) eager's values; SwiGLU's and RMSNorm's backward kernels autograd's
    gradients (the GPU tests check them compiled)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = ROTARY.replace('print("ok")', "") + GRADIENT_KERNELS
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
