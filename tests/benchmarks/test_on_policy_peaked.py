"""benchmarks/on_policy.py's peaked mode: the final norm scaled until the random model's mean
next-token entropy is what was asked (a trained model's sharpness), on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "on_policy.py"


def test_the_final_norm_is_scaled_to_the_entropy_asked(monkeypatch):
    spec = importlib.util.spec_from_file_location("on_policy_benchmark", SCRIPT)
    benchmark = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, benchmark)
    spec.loader.exec_module(benchmark)
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(len(tokenizer)).eval()
    peaked = benchmark.sharpen(model, tokenizer, 0.5)
    assert peaked["entropy_before"] > 2.0
    assert abs(peaked["entropy"] - 0.5) < 0.05 and peaked["norm_scale"] > 1
    ids = torch.tensor([tokenizer("abcdefghij" * 4)["input_ids"]])
    assert benchmark.mean_entropy(model, ids) < 1.0  # the saved model is the sharpened one
