"""The Gumbel-max draw's Triton kernel, run by Triton's interpreter on the CPU against the torch
path (the GPU runs it compiled in the gpu-marked test below). The interpreter is chosen by an
environment variable read when Triton is imported, so the check runs in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

CHECK = """
import torch
from grpoflow.algo import draws
from grpoflow.algo.draw_kernels import gumbel_rows
from grpoflow.algo.truncation import Truncation

torch.manual_seed(0)
logits = (torch.randn(24, 5000) * 3).to(torch.bfloat16)
keys = torch.randint(0, 2**32, (24,))
for truncation in (None, Truncation(top_k=40, top_p=0.9)):
    thresholds = truncation.thresholds(logits.float() / 0.8) if truncation else None
    tokens, logprobs = gumbel_rows(logits, keys, 1 / 0.8, thresholds)
    ref_tokens, ref_logprobs = draws.gumbel_draw(logits, keys, 1 / 0.8, thresholds)
    assert torch.equal(tokens, ref_tokens), (tokens != ref_tokens).sum()
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_gumbel_kernel_matches_the_torch_path_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gumbel_kernel_matches_the_torch_path_on_the_gpu():
    from grpoflow.algo import draws

    torch.manual_seed(0)
    logits = (torch.randn(512, 151936, device="cuda") * 3).to(torch.bfloat16)
    keys = torch.randint(0, 2**32, (512,), device="cuda")
    tokens, logprobs = draws.gumbel_draw(logits, keys, 1.0, None)  # the kernel
    ref_tokens, ref_logprobs = draws.gumbel_draw(logits.cpu(), keys.cpu(), 1.0, None)
    assert (tokens.cpu() != ref_tokens).sum() <= 1  # log rounds differently only next to a tie
    torch.testing.assert_close(logprobs.cpu(), ref_logprobs, atol=1e-4, rtol=1e-4)
