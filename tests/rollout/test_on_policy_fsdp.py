"""on_policy_sampling with the policy sharded by FSDP2 over two CPU processes (gloo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.support import clean_env, finish, free_port, grpoflow_train, read_jsonl, write_config

pytestmark = pytest.mark.slow

COLLECTIVE_TIMEOUT_S = 20
"""How long a rank waits for the other in a collective before its process group fails."""


def test_sharded_replay_agrees_across_ranks_and_a_run_trains_with_no_gap(tmp_path):
    # One process pair for both (most of its time is the imports): the replay outside
    # full_parameters, where one rank settles in one round while the other replaces tokens (without
    # agreeing on their forward passes, the collectives would not pair up); the replay inside it
    # (as a rollout runs it), each rank on its own; the batch-invariant kernels under FSDP; then two
    # steps of a run with fsdp and on_policy_sampling.
    config_path, _ = write_config(
        tmp_path, "run", fsdp=True, on_policy_sampling=True, max_steps=2, beta=0.0, num_iterations=1,
        log_completions=False,
    )  # fmt: skip
    worker = Path(__file__).parents[1] / "helpers" / "on_policy_fsdp_worker.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), str(worker), str(COLLECTIVE_TIMEOUT_S), str(config_path)]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert result.stdout.count("all checks passed") == 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("check", ["update", "replay"])
def test_a_run_with_fsdp_on_the_batch_invariant_kernels_trains_with_no_gap_gpu(tmp_path, check):
    """`pytest -m gpu tests/rollout/test_on_policy_fsdp.py` on a machine with 2 GPUs (NCCL): the
    update's check finds every log-prob equal, or the replay settles in one round."""
    config_path, output_dir = write_config(
        tmp_path, "run", fsdp=True, on_policy_sampling=True, batch_invariant=True, on_policy_check=check,
        torch_dtype="bfloat16", max_steps=2, beta=0.0, num_iterations=1, log_completions=False,
    )  # fmt: skip
    finish(grpoflow_train(config_path, clean_env(), torchrun=True))
    for step in read_jsonl(output_dir / "metrics.jsonl"):
        assert step["sampling/sampling_logp_difference/max"] == 0, step
        if check == "update":
            assert step["on_policy/unverified_fraction"] == 0 and "on_policy/rounds" not in step, step
        else:
            assert step["on_policy/rounds"] == 1 and step["on_policy/replaced_tokens"] == 0, step
