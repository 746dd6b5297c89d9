"""Expert parallelism over two CPU processes (gloo) against one process with every expert, and the
models it refuses to split."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.moe import tiny_moe
from helpers.support import clean_env, free_port

from grpoflow.policy.expert_parallel import expert_parallel_refusal
from grpoflow.policy.lora import AdapterConfig
from grpoflow.policy.tiny import build_tiny_model


def run_worker(*options: str) -> str:
    """tests/helpers/expert_parallel_worker.py on two ranks; its output."""
    worker = Path(__file__).parents[1] / "helpers" / "expert_parallel_worker.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), str(worker), *options]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "all checks passed" in result.stdout
    return result.stdout


@pytest.mark.slow
def test_experts_split_over_two_ranks_give_the_whole_models_logits_and_gradients():
    # Each rank holds 4 of the 8 experts of each layer and runs half of the batch: its logits are
    # the whole model's rows, its experts' gradients the whole model's, and the other gradients
    # summed over both ranks the whole model's. With the router's own choice (looped and grouped
    # products, gradient checkpointing) and with a replayed routing that sends every token to one
    # rank's experts (the other receives none).
    run_worker()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_experts_split_over_two_gpus_give_the_whole_models_logits_and_gradients():
    # The same checks over NCCL; the grouped products (torch._grouped_mm) in bfloat16.
    assert "grouped products unchecked" not in run_worker("--cuda")


def test_expert_parallelism_names_what_it_cannot_split():
    assert expert_parallel_refusal(tiny_moe(), 2) is None
    assert "has no sparse MoE blocks" in expert_parallel_refusal(build_tiny_model(40), 2)
    assert "8 experts, which 3 ranks cannot share evenly" in expert_parallel_refusal(tiny_moe(), 3)
    adapted = AdapterConfig(
        train_type="lora", target_parameters=["experts.gate_up_proj"], lora_rank=4, lora_dropout=0.0
    ).apply(tiny_moe())
    assert "carries LoRA adapters" in expert_parallel_refusal(adapted, 2)
