"""Expert parallelism over two CPU processes (gloo) against one process with every expert, and the
models it refuses to split."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.moe import tiny_moe
from helpers.support import (
    clean_env,
    finish,
    free_port,
    grpoflow_train,
    read_jsonl,
    recipe_values,
    weights,
    write_config,
)

from grpoflow.distributed import DistributedContext
from grpoflow.policy.expert_parallel import expert_parallel_refusal
from grpoflow.policy.lora import AdapterConfig
from grpoflow.policy.tiny import build_tiny_model
from grpoflow.run.build import check_world, run
from grpoflow.run.config import load_config

MOE_RUN = {"model": "random:tiny-moe", "max_steps": 2, "save_steps": 1, "learning_rate": 1e-2}
"""Two steps of the tiny Qwen3-MoE (8 experts a layer), a checkpoint after each."""


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


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    """Two steps on 2 CPU ranks (gloo), each rank keeping 4 of every layer's 8 experts beside
    FSDP's shards of the rest; checkpoints at steps 1 and 2."""
    tmp_path = tmp_path_factory.mktemp("ep")
    config_path, output_dir = write_config(tmp_path, "ep", fsdp=True, expert_model_parallel_size=2, **MOE_RUN)
    finish(grpoflow_train(config_path, clean_env(), torchrun=True))
    return output_dir


@pytest.mark.slow
def test_a_run_with_experts_split_over_two_ranks_trains_and_saves_as_one_process(split_run, tmp_path):
    # The same samples, losses, gradient norms and weights as one process (as FSDP alone gives),
    # every expert in the checkpoint, in the Hugging Face layout transformers loads.
    history = run(
        load_config(None, recipe_values(tmp_path / "one", gradient_accumulation_steps=2, **MOE_RUN))
    )
    logged = read_jsonl(split_run / "metrics.jsonl")
    assert [row["step"] for row in logged] == [1, 2]
    for expected, got in zip(history, logged, strict=True):
        assert got["reward"] == expected["reward"]
        assert got["routing/mismatch_fraction"] == 0.0
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    single, split = weights(tmp_path / "one" / "checkpoint-2"), weights(split_run / "checkpoint-2")
    assert single.keys() == split.keys() and any(".experts." in name for name in single)
    for name in single:
        torch.testing.assert_close(split[name], single[name], atol=1e-5, rtol=0, msg=name)
    expert = "model.layers.0.mlp.experts.5.gate_proj.weight"  # one of rank 1's experts
    moved = (single[expert] - weights(tmp_path / "one" / "checkpoint-1")[expert]).abs().max()
    assert moved > 1e-3  # the experts trained: the comparison can fail

    from transformers import AutoModelForCausalLM

    want, got = (
        AutoModelForCausalLM.from_pretrained(path / "checkpoint-2", dtype=torch.float32).state_dict()
        for path in (tmp_path / "one", split_run)
    )
    assert got.keys() == want.keys() and "model.layers.1.mlp.experts.down_proj" in got
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_a_run_with_experts_split_over_two_ranks_resumes_exactly(split_run, tmp_path):
    # From the step-1 checkpoint (every expert, the optimizer state in full), split again.
    config_path, resumed_dir = write_config(
        tmp_path,
        "resumed",
        fsdp=True,
        expert_model_parallel_size=2,
        resume_from_checkpoint=str(split_run / "checkpoint-1"),
        **MOE_RUN,
    )
    finish(grpoflow_train(config_path, clean_env(), torchrun=True))
    resumed = read_jsonl(resumed_dir / "metrics.jsonl")
    assert [row["step"] for row in resumed] == [2]
    straight = read_jsonl(split_run / "metrics.jsonl")[1]
    assert resumed[0]["reward"] == straight["reward"]
    assert resumed[0]["loss"] == pytest.approx(straight["loss"], abs=1e-7)
    want = weights(split_run / "checkpoint-2")
    for name, tensor in weights(resumed_dir / "checkpoint-2").items():
        torch.testing.assert_close(tensor, want[name], atol=0, rtol=0, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_run_with_experts_split_over_two_gpus_trains_as_fsdp_alone_gpu(tmp_path):
    """`pytest -m gpu tests/policy/test_expert_parallel.py` on a machine with 2 GPUs (NCCL, bf16
    mixed precision, grouped products): the first rollout is the same, and on the same samples the
    losses and gradient norms are those of FSDP alone to bfloat16 rounding. A step whose samples
    differ (the first update's rounding moved a draw) is compared by its shape only. One
    optimizer step a step (num_iterations 1), so that the first checkpoint is one Adam step from
    the same weights in both runs."""
    gpu_run = {**MOE_RUN, "torch_dtype": "float32", "log_completions": False, "num_iterations": 1}
    runs = {}
    for name, layout in (("fsdp", {}), ("ep", {"expert_model_parallel_size": 2})):
        config_path, runs[name] = write_config(tmp_path, name, fsdp=True, **layout, **gpu_run)
        finish(grpoflow_train(config_path, clean_env(), torchrun=True))
    fsdp, split = (read_jsonl(runs[name] / "metrics.jsonl") for name in ("fsdp", "ep"))
    assert split[0]["reward"] == fsdp[0]["reward"]
    for expected, got in zip(fsdp, split, strict=True):
        if got["reward"] != expected["reward"]:
            assert math.isfinite(got["loss"]) and math.isfinite(got["grad_norm"])
            continue
        assert got["loss"] == pytest.approx(expected["loss"], rel=2e-2, abs=1e-3)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=2e-2)
    # Adam's first step moves each weight by at most the learning rate, in its gradient's
    # direction (no weight decay): the two runs' weights are at most two steps apart, where a
    # gradient near zero took opposite signs under their rounding. Few may (1%, or one of a small
    # tensor); a weight further apart was not moved by one Adam step from the same start.
    learning_rate = MOE_RUN["learning_rate"]
    want, got = weights(runs["fsdp"] / "checkpoint-1"), weights(runs["ep"] / "checkpoint-1")
    assert got.keys() == want.keys()
    for name in want:
        apart = (got[name] - want[name]).abs()
        assert apart.max() <= 2 * learning_rate * (1 + 1e-3), (name, apart.max())
        assert (apart > learning_rate).sum() <= max(1, 0.01 * apart.numel()), name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"expert_model_parallel_size": 2},
            "expert_model_parallel_size must be 1 without fsdp.*set fsdp: true",
        ),
        ({"fsdp": True, "expert_model_parallel_size": 0}, "expert_model_parallel_size must be >= 1"),
    ],
)
def test_expert_parallelism_is_refused_where_it_cannot_run(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, recipe_values(tmp_path, model="random:tiny-moe", **overrides))


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        ({}, 2, r"must be 1 or the number of processes \(2\), got 4"),
        ({"rollout_engine": "hf"}, 4, "must be 1 with the hf engine, got 4.*rollout_engine: native"),
        ({"use_vllm": True}, 4, "must be 1 with the vllm engine"),
    ],
)
def test_expert_parallelism_splits_the_experts_over_every_rank_for_the_native_engine(
    overrides, world_size, message
):
    values = recipe_values("out", model="random:tiny-moe", fsdp=True, expert_model_parallel_size=4)
    with pytest.raises(ValueError, match=message):
        check_world(load_config(None, {**values, **overrides}), DistributedContext(world_size=world_size))
    check_world(load_config(None, values), DistributedContext(world_size=4))
