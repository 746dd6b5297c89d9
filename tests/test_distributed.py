"""Data-parallel runs over several processes on the CPU (gloo), against one process."""

from __future__ import annotations

import pytest
import torch
from helpers.support import (
    assert_resumed_run_replays,
    clean_env,
    finish,
    free_port,
    grpoflow_train,
    read_jsonl,
    recipe_values,
    weights,
    write_config,
    write_plugin,
)

from grpoflow.distributed import DistributedContext
from grpoflow.run.build import run
from grpoflow.run.config import load_config


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """4 steps on 2 ranks of 16 completions each, checkpoints at steps 2 and 4."""
    tmp_path = tmp_path_factory.mktemp("two")
    config_path, output_dir = write_config(tmp_path, "run")
    finish(grpoflow_train(config_path, clean_env(), torchrun=True))
    return output_dir


def test_two_processes_equal_one_process_with_twice_the_batch(two_process_run, tmp_path):
    # One process with the global batch split into the same two micro-batches: the same prompts,
    # completions, rewards, losses and weights.
    config = load_config(None, recipe_values(tmp_path / "run", gradient_accumulation_steps=2))
    history = run(config)
    logged = read_jsonl(two_process_run / "metrics.jsonl")
    assert [row["step"] for row in logged] == [1, 2, 3, 4]
    for expected, got in zip(history, logged, strict=True):
        for key in ("reward", "reward_std", "loss", "kl", "grad_norm", "completions/mean_length"):
            assert got[key] == pytest.approx(expected[key], abs=1e-6), key
    single_rows = read_jsonl(tmp_path / "run" / "completions.jsonl")
    two_rows = read_jsonl(two_process_run / "completions.jsonl")
    assert [row["completion"] for row in two_rows] == [row["completion"] for row in single_rows]
    assert [row["advantage"] for row in two_rows] == pytest.approx(
        [row["advantage"] for row in single_rows], abs=1e-6
    )
    single, two = weights(tmp_path / "run" / "checkpoint-4"), weights(two_process_run / "checkpoint-4")
    assert single.keys() == two.keys()
    for name in single:
        torch.testing.assert_close(two[name], single[name], atol=1e-6, rtol=0, msg=name)


def test_two_processes_match_one_process_with_one_micro_batch_of_twice_the_size(two_process_run, tmp_path):
    # One micro-batch of 32 rows instead of two of 16: the same samples and losses, and weights
    # apart only by float rounding (the matmuls see other shapes; Adam magnifies the rounding of
    # near-zero gradients to ~1e-5 over these 8 optimizer steps at learning rate 3e-3).
    history = run(load_config(None, recipe_values(tmp_path / "run", per_device_train_batch_size=32)))
    logged = read_jsonl(two_process_run / "metrics.jsonl")
    for expected, got in zip(history, logged, strict=True):
        assert got["reward"] == expected["reward"]
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    single, two = weights(tmp_path / "run" / "checkpoint-4"), weights(two_process_run / "checkpoint-4")
    for name in single:
        torch.testing.assert_close(two[name], single[name], atol=1e-4, rtol=0, msg=name)


def test_resume_on_two_processes_continues_exactly(two_process_run, tmp_path):
    config_path, output_dir = write_config(
        tmp_path, "resumed", resume_from_checkpoint=str(two_process_run / "checkpoint-2")
    )
    finish(grpoflow_train(config_path, clean_env(), torchrun=True))
    assert_resumed_run_replays(two_process_run, output_dir)


def test_nproc_per_node_relaunches_under_torchrun(tmp_path):
    # Dynamic sampling, with prompts for letters a-d scoring 0 (zero spread): the ranks need
    # different numbers of resampling rounds and must agree on how many they run.
    plugin = write_plugin(tmp_path)
    config_path, output_dir = write_config(
        tmp_path,
        "run",
        max_steps=2,
        log_completions=False,
        reward_funcs=[f"{plugin}:half"],
        dynamic_sample=True,
    )
    env = clean_env(NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    output = finish(grpoflow_train(config_path, env))
    assert "launching under torchrun" in output
    assert output.count("done: 2 steps") == 1  # rank 0 only
    logged = read_jsonl(output_dir / "metrics.jsonl")
    assert [row["step"] for row in logged] == [1, 2]
    assert max(row["dynamic_sample/rounds"] for row in logged) > 1
    assert (output_dir / "checkpoint-2").is_dir()


def test_two_nodes_of_one_process_meet_at_the_master(tmp_path):
    port = str(free_port())
    config_path, output_dir = write_config(tmp_path, "run", max_steps=2, log_completions=False)
    nodes = [
        grpoflow_train(
            config_path,
            clean_env(
                NPROC_PER_NODE="1", NNODES="2", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port
            ),
        )
        for rank in (0, 1)
    ]
    outputs = [finish(node) for node in nodes]
    assert "done: 2 steps" in outputs[0] and "done:" not in outputs[1]
    assert [row["step"] for row in read_jsonl(output_dir / "metrics.jsonl")] == [1, 2]


def test_groups_must_stay_whole_on_a_rank(tmp_path):
    with pytest.raises(ValueError, match="must be divisible by num_generations"):
        load_config(None, recipe_values(tmp_path, per_device_train_batch_size=12))


def test_one_process_context_leaves_everything_as_it_is():
    context = DistributedContext()
    parameter = torch.nn.Parameter(torch.ones(3))
    parameter.grad = torch.full((3,), 2.0)
    context.all_reduce_gradients([parameter])
    assert parameter.grad.tolist() == [2.0, 2.0, 2.0]
    assert context.reduce_metrics({"loss": 1.5}) == {"loss": 1.5}
    assert context.gather_objects("x") == ["x"]
    assert context.max_int(3) == 3


def _reduce_on_rank(rank: int, init_file: str, results) -> None:
    import torch.distributed as torch_dist

    torch_dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        context = DistributedContext(rank=rank, world_size=2)
        metrics = {
            "loss": [1.0, 3.0][rank],
            "time/update": [2.0, 5.0][rank],
            "tokens_per_second/rollout": [10.0, 20.0][rank],
            "sampling/importance_sampling_ratio/max": [1.5, 1.2][rank],
            "sampling/importance_sampling_ratio/min": [0.7, 0.9][rank],
            "on_policy/rounds": [1.0, 3.0][rank],
            "on_policy/replaced_tokens": [2.0, 5.0][rank],
        }
        results[rank] = context.reduce_metrics(metrics)
    finally:
        torch_dist.destroy_process_group()


def test_metrics_are_averaged_summed_or_take_their_extremes_over_ranks(tmp_path):
    import torch.multiprocessing as multiprocessing

    results = multiprocessing.Manager().dict()
    multiprocessing.spawn(_reduce_on_rank, args=(str(tmp_path / "init"), results), nprocs=2)
    expected = {
        "loss": 2.0,
        "time/update": 5.0,
        "tokens_per_second/rollout": 30.0,
        "sampling/importance_sampling_ratio/max": 1.5,
        "sampling/importance_sampling_ratio/min": 0.7,
        "on_policy/rounds": 3.0,
        "on_policy/replaced_tokens": 7.0,
    }
    assert results[0] == pytest.approx(expected) and results[1] == pytest.approx(expected)
