"""`use_liger_kernel`: how auto resolves and why, what true refuses, and Liger's kernels kept to the
model they are applied to (transformers' modeling module and a model built later stay stock). The
kernels themselves run on the CPU through Triton's interpreter, in a fresh process (the interpreter
is chosen when Triton is imported): a tiny model's loss and gradients with them equal the stock
model's.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.support import recipe

from grpoflow.policy import liger
from grpoflow.policy.auto_settings import DeviceFacts
from grpoflow.policy.memory_plan import GIB
from grpoflow.policy.tiny import build_tiny_model
from grpoflow.run.chosen_settings import applied, choose, choose_for_run

READY = liger.LigerFacts(cuda=True, installed=True, model_type="qwen2", torch_compile=False)
"""Every fact for the kernels."""

QWEN = "random:qwen2-0.5b"
needs_liger = pytest.mark.skipif(not liger.installed(), reason="liger-kernel is not installed")


@needs_liger
@pytest.mark.parametrize(
    ("change", "reason", "fix"),
    [
        ({"torch_compile": True}, "torch_compile is on", "set torch_compile: false"),
        ({"batch_invariant": True}, "the batch-invariant kernels run", "set batch_invariant: false"),
        ({"cuda": False}, "no CUDA device", "train on a CUDA GPU"),
        ({"installed": False}, "liger-kernel is not installed", "pip install grpoflow[liger]"),
        ({"model_type": "gpt2"}, "no kernels for model type 'gpt2'", "leave it to a supported model"),
    ],
)
def test_auto_is_off_and_true_refused_where_a_fact_fails(change, reason, fix):
    import dataclasses

    facts = dataclasses.replace(READY, **change)
    on, why = liger.choose("auto", facts)
    assert not on and why.startswith("auto: off") and reason in why
    with pytest.raises(ValueError, match="use_liger_kernel: true cannot run") as error:
        liger.choose(True, facts)
    assert reason in str(error.value) and fix in str(error.value) and "\n" not in str(error.value)
    assert liger.choose(False, facts) == (False, "set false")


@needs_liger
def test_auto_is_on_where_every_fact_holds_and_yields_only_to_a_given_batch_invariant():
    import dataclasses

    on, why = liger.choose("auto", READY)
    assert on and why.startswith("auto: on") and "'qwen2'" in why
    assert liger.choose(True, READY) == (True, "set true")
    auto_invariant = dataclasses.replace(READY, batch_invariant_runs=True)
    assert not liger.choose("auto", auto_invariant)[0]  # the batch-invariant kernels' auto runs
    assert liger.choose(True, auto_invariant)[0]  # given true, theirs yields


@needs_liger
def test_a_gpu_run_records_the_choice_and_its_reason(tmp_path):
    gpu = DeviceFacts("cuda", 80 * GIB, compile_available=True)
    short = recipe(tmp_path, model=QWEN, max_steps=5, gpu_name="H100")
    chosen = choose(short, gpu)  # compiling would not pay: compile off, Liger on
    assert not chosen.torch_compile and chosen.use_liger_kernel
    assert chosen.record()["use_liger_kernel"]["reason"].startswith("auto: on")
    assert chosen.record()["use_liger_kernel"]["source"] == "default"
    assert applied(short, chosen).policy.use_liger_kernel is True
    compiled = choose(recipe(tmp_path, model=QWEN, torch_compile=True), gpu)
    assert not compiled.use_liger_kernel and "torch_compile is on" in compiled.reasons["use_liger_kernel"]
    given = choose(recipe(tmp_path, model=QWEN, max_steps=500, use_liger_kernel=True), gpu)
    assert given.use_liger_kernel and not given.torch_compile  # compile is not chosen beside it
    with pytest.raises(ValueError, match="set torch_compile: false"):
        choose(recipe(tmp_path, model=QWEN, use_liger_kernel=True, torch_compile=True), gpu)
    with pytest.raises(ValueError, match="set batch_invariant: false"):
        choose(recipe(tmp_path, model=QWEN, use_liger_kernel=True, batch_invariant=True), gpu)


def test_the_cpu_leaves_the_kernels_off_and_refuses_true(tmp_path):
    trained, chosen = choose_for_run(recipe(tmp_path))
    assert trained.policy.use_liger_kernel is False
    assert chosen.record()["use_liger_kernel"] == {
        "value": False,
        "source": "default",
        "reason": "auto: off, no CUDA device (the kernels are Triton GPU kernels)",
    }
    with pytest.raises(
        ValueError, match="no CUDA device.*train on a CUDA GPU or set use_liger_kernel: false"
    ):
        choose_for_run(recipe(tmp_path, use_liger_kernel=True))


@needs_liger
def test_the_kernels_stay_on_the_model_they_are_applied_to(tmp_path):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.qwen2 import modeling_qwen2

    stock = {
        name: getattr(modeling_qwen2, name) for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP")
    }
    model = build_tiny_model(100, seed=0)
    names = list(model.state_dict())
    liger.apply(model)
    assert {name: getattr(modeling_qwen2, name) for name in stock} == stock
    layer = model.model.layers[0]
    assert layer.self_attn.forward.__func__.__globals__["apply_rotary_pos_emb"] is liger_rotary_pos_emb
    assert "forward" in vars(layer.mlp) and "forward" in vars(layer.input_layernorm)
    assert list(model.state_dict()) == names  # checkpoints, weight syncs and engines read the same names
    reference = copy.deepcopy(model)  # the reference model: its kernels bound to its own modules
    assert reference.model.layers[0].self_attn.forward.__self__ is reference.model.layers[0].self_attn
    later = build_tiny_model(100, seed=0)
    assert "forward" not in vars(later.model.layers[0].self_attn)
    ids = torch.randint(0, 100, (2, 9))
    torch.testing.assert_close(later(ids).logits, build_tiny_model(100, seed=0)(ids).logits)
    model.save_pretrained(tmp_path / "saved")
    from safetensors.torch import load_file

    assert sorted(load_file(tmp_path / "saved" / "model.safetensors")) == sorted(
        name for name in names if name != "lm_head.weight"
    )


INTERPRETED = """
import copy
import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

# Two gaps of Triton's interpreter that compiled kernels do not have: a float argument stays a
# Python float (compiled, an fp32 scalar, on which Liger's RMSNorm calls .to), and libdevice's
# rsqrt has no interpreted version.
_convert = interpreter._implicit_cvt
def _convert_float(arg):
    if isinstance(arg, float):
        return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
    return _convert(arg)
interpreter._implicit_cvt = _convert_float
import liger_kernel.ops.rms_norm as rms_norm_ops
rms_norm_ops.rsqrt = lambda x: tl.rsqrt(x)

from grpoflow.policy import liger
from grpoflow.policy.tiny import build_tiny_model

for shape in ({}, {"model_type": "qwen3", "head_dim": 16}):  # Qwen3: per-head q/k norms too
    stock = build_tiny_model(100, seed=0, **shape)
    fused = copy.deepcopy(stock)
    liger.apply(fused)
    fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fused.train()
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, 7, 100, generator=torch.Generator().manual_seed(2))
    outputs = []
    for model in (stock, fused):
        logits = model(ids).logits
        (logits.log_softmax(-1) * weights).sum().backward()
        outputs.append((logits, {name: p.grad for name, p in model.named_parameters()}))
    (stock_logits, stock_grads), (fused_logits, fused_grads) = outputs
    torch.testing.assert_close(fused_logits, stock_logits, atol=1e-5, rtol=1e-5)
    for name, grad in stock_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
print("ok")
"""


@needs_liger
def test_the_kernels_give_the_stock_loss_and_gradients_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(INTERPRETED)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
