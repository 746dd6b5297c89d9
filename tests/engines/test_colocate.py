"""Colocated engines over several ranks: the layout of engines and seeds, the pooling of a
tensor-parallel group's prompts, and colocated vLLM under torchrun (skipped without vLLM)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import support

from grpoflow.engines.colocate import ColocateLayout, EngineGroup, merge_shares, own_share
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model
from grpoflow.run.build import build_trainer

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def test_ranks_form_consecutive_groups_with_one_seed_per_engine():
    layouts = [ColocateLayout(rank=rank, world_size=4, tensor_parallel_size=2) for rank in range(4)]
    assert layouts[0].group_ranks() == [[0, 1], [2, 3]] and layouts[0].num_engines == 2
    assert [layout.engine_index for layout in layouts] == [0, 0, 1, 1]
    assert [layout.rank_in_group for layout in layouts] == [0, 1, 0, 1]
    assert [layout.engine_seed(42) for layout in layouts] == [42, 42, 43, 43]
    alone = [ColocateLayout(rank=rank, world_size=3).engine_seed(7) for rank in range(3)]
    assert alone == [7, 8, 9]


def test_a_tensor_parallel_size_that_does_not_divide_the_world_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"does not divide the 6 training.*one of 1, 2, 3, 6"):
        ColocateLayout(rank=0, world_size=6, tensor_parallel_size=4)
    # A single process asking for two GPUs per engine is refused before the model is loaded.
    config = support.recipe(tmp_path, model="no/such-model", use_vllm=True, vllm_tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"vllm_tensor_parallel_size=2 does not divide the 1 training"):
        build_trainer(config)


def test_a_group_submits_every_ranks_requests_and_each_takes_back_its_own():
    shares = [["a", "b"], [], ["c"]]
    requests, sizes = merge_shares(shares)
    assert requests == ["a", "b", "c"] and sizes == [2, 0, 1]
    outputs = [request.upper() for request in requests]
    assert [own_share(outputs, sizes, index) for index in range(3)] == [["A", "B"], [], ["C"]]
    with pytest.raises(ValueError, match="got 2 outputs for 3 requests"):
        own_share(outputs[:2], sizes, 0)


def _gather_in_groups(rank: int, init_file: str, results) -> None:
    import torch.distributed as torch_dist

    torch_dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    try:
        group = EngineGroup(ColocateLayout(rank=rank, world_size=4, tensor_parallel_size=2))
        results[rank] = group.gather([rank] * (rank % 3))
        group.close()
    finally:
        torch_dist.destroy_process_group()


def test_engine_groups_gather_within_their_own_ranks(tmp_path):
    import torch.multiprocessing as multiprocessing

    results = multiprocessing.Manager().dict()
    multiprocessing.spawn(_gather_in_groups, args=(str(tmp_path / "init"), results), nprocs=4)
    assert results[0] == results[1] == [[], [1]]
    assert results[2] == results[3] == [[2, 2], []]
    assert EngineGroup(ColocateLayout()).gather("x") == ["x"]


def colocated_run(tmp_path: Path, **overrides) -> list[dict]:
    """What each rank observed in 2 steps of a colocated-vLLM run on 2 torchrun ranks
    (tests/vllm_colocate_worker.py)."""
    tokenizer = build_char_tokenizer()
    model_dir = tmp_path / "model"
    build_tiny_model(len(tokenizer), **support.VLLM_TINY_SHAPE).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    config_path, _ = support.write_config(
        tmp_path,
        "run",
        model=str(model_dir),
        use_vllm=True,
        vllm_enforce_eager=True,
        max_steps=2,
        log_completions=False,
        **overrides,
    )
    worker = Path(__file__).parents[1] / "helpers" / "vllm_colocate_worker.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(support.free_port()), str(worker), str(config_path)]
    env = support.clean_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


@needs_vllm
@pytest.mark.slow
def test_two_ranks_train_with_an_engine_each_seeded_apart(tmp_path):
    ranks = colocated_run(tmp_path)
    assert len(ranks[0]["history"]) == 2
    assert all(step["sync/check_logprob_gap"] < 1e-2 for step in ranks[0]["history"])
    assert [rank["engine_index"] for rank in ranks] == [0, 1] and ranks[0]["num_engines"] == 2
    # Unseeded samples of one prompt: each engine draws from its own seed.
    assert ranks[0]["unseeded"] != ranks[1]["unseeded"]
    for rank in ranks:  # every engine took the trained weights
        assert rank["policy_version"] == 2
        assert rank["changed"] and rank["trainer_gap"] < 2e-3


@needs_vllm
@pytest.mark.slow
def test_two_ranks_share_one_tensor_parallel_engine(tmp_path):
    # Dynamic sampling with prompts for letters a-d scoring 0: the ranks lack different numbers
    # of prompts in a round, and one that lacks none must still generate with its group.
    plugin = support.write_plugin(tmp_path)
    ranks = colocated_run(
        tmp_path,
        vllm_tensor_parallel_size=2,
        move_model_batches=2,
        dynamic_sample=True,
        reward_funcs=[f"{plugin}:half"],
    )
    assert max(step["dynamic_sample/rounds"] for step in ranks[0]["history"]) > 1
    assert [rank["engine_index"] for rank in ranks] == [0, 0] and ranks[0]["num_engines"] == 1
    counts = [rank["prompt_counts"] for rank in ranks]
    assert len(counts[0]) == len(counts[1])  # the ranks called their shared engine together
    assert any(0 in pair and pair != (0, 0) for pair in zip(*counts))
    for rank in ranks:  # both shards took the trained weights, pushed in 2 groups
        assert rank["changed"] and rank["trainer_gap"] < 2e-3
