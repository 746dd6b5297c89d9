"""The native engine's sampling, decode-attention, paged-prefix attention and RMSNorm Triton
kernels, run by Triton's interpreter on the CPU against their torch references (the GPU runs them
compiled in test_native_gpu.py).

The interpreter is chosen by an environment variable read when Triton is imported, so each check
runs in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SAMPLER = """
import numpy as np, torch
from grpoflow.engines.base import SamplingParams
from grpoflow.kernels.decoder import sample_rows
from grpoflow.engines.native.sampler import SamplingOptions, sample_reference

torch.manual_seed(0)
logits = (torch.randn(48, 3000) * 3).to(torch.bfloat16)
keys = torch.from_numpy(np.random.default_rng(0).integers(0, 2**32, 48))
for greedy, filters in [(True, False), (False, False), (False, True)]:
    options = SamplingOptions.from_params(SamplingParams(temperature=0.8, top_p=0.9 if filters else 1.0, top_k=50 if filters else 0))
    inverse = 1.0 if greedy else 1 / 0.8
    thresholds = options.truncation.thresholds(logits.float() * inverse) if filters else None
    out = torch.full((48,), -7, dtype=torch.int64)
    tokens, logprobs = sample_rows(logits, keys, inverse, greedy, thresholds, tokens_out=out)
    ref_tokens, ref_logprobs = sample_reference(logits, keys, inverse, greedy, thresholds)
    assert tokens.data_ptr() == out.data_ptr()
    assert torch.equal(tokens, ref_tokens), (greedy, filters, (tokens != ref_tokens).sum())
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)
print("ok")
"""

ATTENTION = """
import torch
from grpoflow.kernels.decoder import TritonOps
from grpoflow.kernels.ops import DecodeBatch, TorchOps

torch.manual_seed(0)
rows, kv_heads, dim, block_size, blocks = 9, 2, 64, 16, 120
for group in (1, 7):
    for window in (0, 37):
        for norm in (False, True):
            heads = kv_heads * group
            qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
            half = torch.rand(300, dim // 2) * 6
            angles = torch.cat((half, half), -1)
            context = torch.randint(1, 10 * block_size, (rows,))
            context[0], context[1] = 0, 1
            table = torch.randperm(blocks)[: rows * 10].view(rows, 10).int()
            positions = (context - 1).clamp(min=0)
            slots = table[torch.arange(rows), positions // block_size].long() * block_size
            slots = torch.where(context > 0, slots + positions % block_size, -1)
            batch = DecodeBatch(angles.cos(), angles.sin(), positions, slots, table, context, int(context.max()))
            qk_norm = (torch.randn(dim), torch.randn(dim), 1e-6) if norm else None
            results = []
            # the context whole, in 3 shares, and in 16 (most of them empty)
            for ops, splits in ((TorchOps, None), (TritonOps, 1), (TritonOps, 3), (TritonOps, 16)):
                caches = torch.randn(2, blocks, kv_heads, block_size, dim, generator=torch.Generator().manual_seed(1))
                q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
                q, k, v = q.view(rows, heads, dim), k.view(rows, kv_heads, dim), v.view(rows, kv_heads, dim)
                extra = {} if splits is None else {"splits": splits}
                out = ops.decode_layer_attention(q, k, v, caches[0], caches[1], batch, dim**-0.5, window, qk_norm, **extra)
                results.append((out, caches))
            (ref, ref_caches), *split_results = results
            for out, caches in split_results:
                assert (out[0] == 0).all()
                torch.testing.assert_close(out[1:], ref[1:], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(caches, ref_caches, atol=1e-5, rtol=1e-5)
print("ok")
"""

RMS_NORM = """
import torch
from grpoflow.kernels.decoder import TritonOps
from grpoflow.kernels.ops import TorchOps

torch.manual_seed(0)
# The interpreter rounds to bfloat16 its own way: bfloat16 results agree within a few units.
for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 5e-2)):
    x, residual = torch.randn(2, 7, 96).to(dtype).unbind(0)
    weight = torch.randn(96).to(dtype)
    for unit_offset in (False, True):
        for res in (None, residual):
            out, summed = TritonOps.rms_norm(x, weight, 1e-6, res, unit_offset=unit_offset)
            ref, ref_summed = TorchOps.rms_norm(x, weight, 1e-6, res, unit_offset=unit_offset)
            torch.testing.assert_close(out, ref, atol=tolerance, rtol=tolerance)
            torch.testing.assert_close(summed, ref_summed, atol=tolerance, rtol=tolerance)
print("ok")
"""


PREFIX_ATTENTION = """
import torch
from helpers.prefix_attention import check_paged_prefix_attention

check_paged_prefix_attention("cpu", torch.float32, 1e-5)
print("ok")
"""


def _interpret(source: str) -> None:
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_sampling_kernel_matches_reference_interpreted():
    _interpret(SAMPLER)


def test_decode_attention_kernel_matches_reference_interpreted():
    _interpret(ATTENTION)


def test_rms_norm_kernel_matches_reference_interpreted():
    """Llama's norm and Gemma's (`unit_offset`: 1 + weight in float32), with and without a residual."""
    _interpret(RMS_NORM)


def test_paged_prefix_attention_kernel_matches_reference_interpreted():
    _interpret(PREFIX_ATTENTION)
