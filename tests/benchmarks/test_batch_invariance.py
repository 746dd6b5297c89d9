"""benchmarks/batch_invariance.py's model through the batch-invariant kernels: its paged-cache
decode gives the logits of its full forward bit for bit, on the CPU (Triton's interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
CHECK = """
import torch
import batch_invariant_model as bim
from grpoflow.policy.tiny import build_preset_model

model = build_preset_model("tiny", 100)
with torch.no_grad():
    for layer in model.model.layers:
        layer.self_attn.q_proj.bias.normal_(0, 0.5)
result = bim.identity_check(model, 3, 12)["batch-invariant kernels"]
assert result["positions"] > 12 and result["identical"] == result["positions"], result
print("ok")
"""


def test_decoded_logits_equal_the_full_forward_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(BENCHMARKS), *sys.path])}
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
