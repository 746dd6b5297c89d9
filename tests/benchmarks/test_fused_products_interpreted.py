"""benchmarks/fused_products.py's kernels, run by Triton's interpreter on the CPU, agree with the
native engine's separate ops (`TorchOps.rms_norm`, `silu_mul`) and `F.linear`, so that
decode_products.py times kernels that compute the same thing. float32 and float16: the
interpreter's bfloat16 products are not exact."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

CHECK = """
import torch
import torch.nn.functional as F
from fused_products import Tiles, gated_product, norm_gated_product, norm_product, plain_product
from grpoflow.kernels.ops import TorchOps

torch.manual_seed(0)
# the chosen tiles (hand prefetch, a 96-wide input in 64-wide tiles: masked) and small ones without
for dtype, tolerance in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
    for rows, hidden, width in ((7, 96, 80), (70, 128, 200)):
        x, residual = torch.randn(2, rows, hidden).to(dtype).unbind(0)
        norm = torch.randn(hidden).to(dtype)
        weight = (torch.randn(width, hidden) / hidden**0.5).to(dtype)
        bias = torch.randn(width).to(dtype)
        for tiles in (None, Tiles(16, 32, 32, 4, 2, False)):
            for res, b in ((None, None), (residual, bias)):
                out, summed = norm_product(x, norm, 1e-6, res, weight, b, tiles)
                normed, ref_summed = TorchOps.rms_norm(x, norm, 1e-6, res)
                torch.testing.assert_close(out, F.linear(normed, weight, b), atol=3 * tolerance, rtol=tolerance)
                torch.testing.assert_close(summed, ref_summed, atol=tolerance, rtol=tolerance)
            out, summed = norm_gated_product(x, norm, 1e-6, residual, weight, tiles)
            normed, ref_summed = TorchOps.rms_norm(x, norm, 1e-6, residual)
            ref = TorchOps.silu_mul(*F.linear(normed, weight).chunk(2, -1))
            torch.testing.assert_close(out, ref, atol=3 * tolerance, rtol=tolerance)
            gate, up = torch.randn(rows, 2 * hidden).to(dtype).chunk(2, -1)
            ref = F.linear(TorchOps.silu_mul(gate, up), weight, bias)
            torch.testing.assert_close(gated_product(gate, up, weight, bias, tiles), ref, atol=3 * tolerance, rtol=tolerance)
            torch.testing.assert_close(plain_product(x, weight, None, tiles), F.linear(x, weight), atol=3 * tolerance, rtol=tolerance)
print("ok")
"""


def test_fused_products_match_the_separate_ops_interpreted():
    path = os.pathsep.join(filter(None, [str(BENCHMARKS), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHECK)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
