"""num_infer_workers: rollout servers the run starts beside its training processes."""

from __future__ import annotations

import pytest
from helpers import support

from grpoflow.run.build import build_trainer, run
from grpoflow.run.infer_workers import worker_gpus


def test_servers_take_the_gpus_after_the_training_processes_split_evenly():
    assert worker_gpus(2, 0, 1, 4) == [1, 2]
    assert worker_gpus(4, 0, 2, 8) == [2, 3] and worker_gpus(4, 1, 2, 8) == [4, 5]
    assert worker_gpus(2, 1, 2, None) == [None]  # CPU servers


def test_impossible_layouts_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="multiple of 2"):
        worker_gpus(3, 0, 2, 8)
    with pytest.raises(ValueError, match="need 16 GPUs, but this node has 8"):
        worker_gpus(8, 0, 8, 8)
    with pytest.raises(ValueError, match="leave use_vllm"):
        support.recipe(support.Path("/tmp"), num_infer_workers=1, use_vllm=True)


def test_a_run_starts_trains_against_and_stops_its_rollout_server(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    config = support.recipe(
        tmp_path, max_steps=3, num_infer_workers=1, async_generate=True, learning_rate=3e-3
    )
    trainer = build_trainer(config)
    (url,) = trainer.engine.urls
    history = run(config, trainer)
    assert [step["async/staleness"] for step in history] == [0.0, 1.0, 1.0]
    # The server holds the trained weights after every sync.
    assert all(step["sync/check_logprob_gap"] < 1e-3 for step in history)
    assert (tmp_path / "run" / "infer_workers").is_dir()
    with pytest.raises(httpx.HTTPError):  # stopped with the run
        httpx.get(url + "/health", timeout=2)


@pytest.mark.slow
def test_two_training_processes_drive_one_server_each(tmp_path):
    pytest.importorskip("fastapi")
    config_path, output_dir = support.write_config(
        tmp_path, "run", num_infer_workers=2, async_generate=True, num_iterations=1, beta=0.0
    )
    support.finish(support.grpoflow_train(config_path, support.clean_env(), torchrun=True))
    logged = support.read_jsonl(output_dir / "metrics.jsonl")
    assert [row["async/staleness"] for row in logged] == [0.0, 1.0, 1.0, 1.0]
    # Every rank's server took the collective updates: the post-sync check held on both.
    assert all(row["sync/check_logprob_gap"] < 1e-3 for row in logged)
    logs = list((output_dir / "infer_workers").glob("server-*.log"))
    assert len(logs) == 2
    assert all("POST /init_weight_transfer_engine" in log.read_text() for log in logs)  # collective


@pytest.mark.slow
def test_two_nodes_each_start_their_own_rollout_server(tmp_path):
    """The README's multi-node async command, as 2 "nodes" of 1 training process + 1 server."""
    pytest.importorskip("fastapi")
    port = str(support.free_port())
    config_path, output_dir = support.write_config(
        tmp_path, "run", max_steps=2, num_infer_workers=1, async_generate=True, log_completions=False
    )
    nodes = [
        support.grpoflow_train(
            config_path,
            support.clean_env(
                NPROC_PER_NODE="1", NNODES="2", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port
            ),
        )
        for rank in (0, 1)
    ]
    outputs = [support.finish(node) for node in nodes]
    assert "done: 2 steps" in outputs[0]
    logged = support.read_jsonl(output_dir / "metrics.jsonl")
    assert [row["async/staleness"] for row in logged] == [0.0, 1.0]
    assert len(list((output_dir / "infer_workers").glob("server-*.log"))) == 2
