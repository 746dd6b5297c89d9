"""The experts as grouped products with fused kernels (`experts_implementation=grpoflow_grouped`):
outputs and gradients against transformers' eager experts for the whole tiny Qwen3-MoE, with PEFT
adapters on the experts and under checkpointing; the kernels under Triton's interpreter against
their torch expressions; the choice of the implementation. CPU; the bf16 comparison with
transformers' grouped_mm runs on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from helpers.moe import VOCAB, tiny_moe  # noqa: E402

from grpoflow.kernels import grouped_experts  # noqa: E402
from grpoflow.policy.loading import (
    GROUPED_EXPERTS,
    default_experts_implementation,
    set_experts_implementation,
)  # noqa: E402

CPU = torch.device("cpu")


def _grads(model, ids: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (logits * upstream).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _compare(reference, candidate, ids, tolerance: float = 1e-9) -> None:
    upstream = torch.randn(*ids.shape, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logits, grads = _grads(reference, ids, upstream)
    other_logits, other_grads = _grads(candidate, ids, upstream)
    assert torch.allclose(other_logits, logits, atol=tolerance, rtol=0)
    assert grads.keys() == other_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.allclose(other_grads[name], grad, atol=tolerance, rtol=0), name


def _pair(**overrides):
    eager = tiny_moe(**overrides).double()
    ours = tiny_moe(**overrides).double()
    set_experts_implementation(eager, "eager", CPU)
    set_experts_implementation(ours, GROUPED_EXPERTS, CPU)
    assert ours.config._experts_implementation == GROUPED_EXPERTS
    return eager, ours


def test_the_models_outputs_and_every_gradient_are_eagers():
    """Router, experts (gate_up and down), attention and embeddings: float64, so any slip in the
    sorted rows, the routing weights' gradients or SwiGLU's backward shows."""
    eager, ours = _pair()
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0))
    _compare(eager, ours, ids)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "olmoe"])
def test_the_other_families_with_softmax_routers_are_eagers(family):
    """Qwen2-MoE (with its shared expert), Mixtral and OLMoE keep their experts in the same
    layout: ours runs them (the default on CUDA) with eager's outputs and gradients."""
    import transformers

    small = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    small |= dict(num_key_value_heads=2, intermediate_size=48, num_experts_per_tok=3)
    config = {
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **small, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6
        ),
        "mixtral": lambda: transformers.MixtralConfig(**small, num_local_experts=6),
        "olmoe": lambda: transformers.OlmoeConfig(**small, num_experts=6),
    }[family]()
    models = []
    for implementation in ("eager", GROUPED_EXPERTS):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).double()
        assert grouped_experts.experts_refusal(model) is None
        set_experts_implementation(model, implementation, CPU)
        models.append(model)
    _compare(*models, torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(6)))


def test_frozen_experts_get_no_gradient_and_the_rest_are_eagers():
    eager, ours = _pair()
    for model in (eager, ours):
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(".experts." not in name)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    _compare(eager, ours, ids)


def test_checkpointed_layers_recompute_the_same_gradients():
    eager, ours = _pair()
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ours.train()
    eager.train()
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    _compare(eager, ours, ids)


def test_peft_adapters_on_the_experts_get_eagers_gradients():
    peft = pytest.importorskip("peft")
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.0)
    config["target_parameters"] = ["experts.gate_up_proj", "experts.down_proj"]
    eager, ours = _pair()
    models = []
    for model in (eager, ours):
        torch.manual_seed(5)
        adapted = peft.get_peft_model(model, peft.LoraConfig(**config, init_lora_weights=False))
        models.append(adapted)
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    _compare(*models, ids)


def test_the_choice_of_implementation():
    """Unset: eager on the CPU, ours on CUDA for SiLU experts, grouped_mm for others; ours asked
    for a model it cannot run is refused with the fix."""
    model = tiny_moe()
    assert default_experts_implementation(model, CPU) == ("eager", "the default on cpu")
    assert default_experts_implementation(model, torch.device("cuda")) == (
        GROUPED_EXPERTS,
        "the default on cuda",
    )
    gelu = tiny_moe(hidden_act="gelu")
    assert default_experts_implementation(gelu, torch.device("cuda")) == (
        "grouped_mm",
        "the default on cuda for hidden_act='gelu' (the kernel's gate is SiLU)",
    )
    with pytest.raises(ValueError, match="cannot run this model's experts: hidden_act='gelu'.*grouped_mm"):
        set_experts_implementation(gelu, GROUPED_EXPERTS, CPU)


KERNELS = r"""
import torch
from grpoflow.kernels import grouped_experts as ge
from grpoflow.kernels.batch_invariant_cpu import triton_runs

def torch_path(fn, *args):
    # The same function's torch expression: run it with the interpreter switched off for it.
    ge.triton_runs = lambda tensor: False
    try:
        return fn(*args)
    finally:
        ge.triton_runs = triton_runs

g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    rows = torch.randn(21, 40, generator=g).to(dtype)
    slots = torch.randperm(21, generator=g).view(7, 3)
    weights = torch.rand(7, 3, generator=g).to(dtype)
    fused = torch.randn(21, 2 * 40, generator=g).to(dtype)
    act_grad = torch.randn(21, 40, generator=g).to(dtype)
    assert triton_runs(rows)
    exact = dtype == torch.float32
    def same(a, b):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        tolerance = 1e-5 if exact else 2e-2
        assert torch.allclose(a.float(), b.float(), atol=tolerance, rtol=tolerance), (a - b).abs().max()
    for scale in (weights, None):
        same(ge.weighted_sum(rows, slots, scale), torch_path(ge.weighted_sum, rows, slots, scale))
    sorted_weights = weights.reshape(-1)
    same(ge.swiglu(fused), torch_path(ge.swiglu, fused))
    for dots in (True, False):
        ours = ge.swiglu_backward(fused, act_grad, sorted_weights, dots)
        theirs = torch_path(ge.swiglu_backward, fused, act_grad, sorted_weights, dots)
        same(ours[0], theirs[0])
        assert (ours[1] is None) == (not dots)
        if dots:
            same(ours[1], theirs[1])
    # rows wider than one block: the backward's loop over column blocks
    wide = torch.randn(3, 2 * 5000, generator=g).to(dtype)
    wide_grad = torch.randn(3, 5000, generator=g).to(dtype)
    ours = ge.swiglu_backward(wide, wide_grad, sorted_weights[:3], True)
    theirs = torch_path(ge.swiglu_backward, wide, wide_grad, sorted_weights[:3], True)
    same(ours[0], theirs[0]); same(ours[1], theirs[1])
    same(ge.weighted_sum(wide, slots[:2, :2] % 3, weights[:2, :2]), torch_path(ge.weighted_sum, wide, slots[:2, :2] % 3, weights[:2, :2]))
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the bf16 test runs the kernels compiled")
def test_the_kernels_interpreted_are_their_torch_expressions():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", KERNELS], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="grouped products in bfloat16 run on CUDA")
def test_bf16_on_the_gpu_matches_transformers_grouped_mm():
    """A Qwen3-30B-A3B-shaped layer (hidden 2048, 128 experts, 8 per token, width 768), 512 tokens:
    ours and transformers' grouped_mm agree to bf16 rounding, forward and every gradient."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8
    )
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config).cuda().bfloat16()
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(512, 128, device="cuda", requires_grad=True)
    chosen = logits.detach().topk(8, dim=-1).indices
    upstream = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    inputs = [x, logits, module.gate_up_proj, module.down_proj]

    def weights():
        return logits.softmax(-1).gather(1, chosen).bfloat16()

    theirs = module(x, chosen, weights())
    their_grads = torch.autograd.grad(theirs, inputs, upstream)
    ours = grouped_experts.experts(x, module.gate_up_proj, module.down_proj, chosen, weights())
    our_grads = torch.autograd.grad(ours, inputs, upstream)
    for a, b in zip([ours, *our_grads], [theirs, *their_grads], strict=True):
        error = (a.float() - b.float()).norm() / b.float().norm()
        assert error < 1e-2, error
