"""Liger's kernels on CUDA: a tiny and a Qwen2-0.5B-shaped random model's forward and backward
(gradient checkpointing on, bfloat16) agree with the stock model's to bfloat16's rounding, and a
short `grpoflow train` with use_liger_kernel auto turns them on, trains (full and LoRA, the
reference model too), saves its checkpoint under the stock parameter names and records the choice
in run.json."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.support import recipe

from grpoflow.policy import liger, lora
from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model
from grpoflow.run.build import build_trainer, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not liger.installed(), reason="needs liger-kernel (pip install grpoflow[liger])"),
]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize(("preset", "length"), [("tiny", 64), ("qwen2-0.5b", 384)])
def test_the_kernels_give_the_stock_forward_and_backward_in_bfloat16(preset, length):
    stock = build_preset_model(
        preset, len(build_char_tokenizer()), seed=0, dtype=torch.bfloat16, device="cuda"
    )
    fused = copy.deepcopy(stock)
    liger.apply(fused)
    ids = torch.randint(
        0,
        stock.config.vocab_size,
        (4, length),
        device="cuda",
        generator=torch.Generator("cuda").manual_seed(1),
    )
    results = []
    for model in (stock, fused):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        log_probs = model(ids).logits.float().log_softmax(-1)
        log_probs.gather(-1, ids[..., None]).mean().backward()
        results.append((log_probs.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (stock_logp, stock_grads), (fused_logp, fused_grads) = results
    assert relative_error(fused_logp, stock_logp) < 1e-2
    errors = {name: relative_error(fused_grads[name], grad) for name, grad in stock_grads.items()}
    assert max(errors.values()) < 5e-2, sorted(errors.items(), key=lambda item: -item[1])[:5]


@pytest.mark.parametrize("train_type", ["full", "lora"])
def test_a_short_run_turns_the_kernels_on_trains_and_records_why(tmp_path, train_type):
    config = recipe(
        tmp_path, max_steps=2, save_steps=2, beta=0.04, torch_compile=False, train_type=train_type
    )
    trainer = build_trainer(config)
    layer = lora.generation_model(trainer.placement.module).model.layers[0]
    assert "forward" in vars(layer.mlp) and "forward" in vars(layer.input_layernorm)
    metrics = run(config, trainer)
    assert len(metrics) == 2 and all(step["weights/nonfinite"] == 0 for step in metrics)
    record = json.loads((tmp_path / "run" / "run.json").read_text())["chosen_settings"]["use_liger_kernel"]
    assert record["value"] is True and record["reason"].startswith("auto: on"), record
    saved = next((tmp_path / "run").glob("checkpoint-2"))
    if train_type == "full":
        from safetensors.torch import load_file

        names = set(load_file(saved / "model.safetensors"))
        assert "model.layers.0.mlp.gate_proj.weight" in names
        assert "model.layers.0.input_layernorm.weight" in names
