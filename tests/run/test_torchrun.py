"""`grpoflow train` launching itself under torchrun from NPROC_PER_NODE, NNODES, NODE_RANK,
MASTER_ADDR and MASTER_PORT."""

from __future__ import annotations

import pytest

from grpoflow.run.torchrun import torchrun_command, wants_launch


def test_torchrun_command_passes_the_launch_variables_and_arguments():
    env = {
        "NPROC_PER_NODE": "8",
        "NNODES": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29600",
    }
    command = torchrun_command(["--config", "r.yaml", "--max_steps", "3"], env)
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert " ".join(command[3:]) == (
        "--nproc_per_node 8 --nnodes 2 --node_rank 1 --master_addr 10.0.0.1 --master_port 29600 "
        "-m grpoflow.cli train --config r.yaml --max_steps 3"
    )
    defaults = torchrun_command([], {"NPROC_PER_NODE": "2"})
    assert " ".join(defaults[3:13]) == (
        "--nproc_per_node 2 --nnodes 1 --node_rank 0 --master_addr 127.0.0.1 --master_port 29500"
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NPROC_PER_NODE": "two"}, "NPROC_PER_NODE must be a positive integer, got 'two'"),
        ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE must be a positive integer, got '0'"),
        ({"NPROC_PER_NODE": "2", "NNODES": "-1"}, "NNODES must be a positive integer"),
        (
            {"NPROC_PER_NODE": "2", "NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"},
            "NODE_RANK must be in 0 .. ",
        ),
        ({"NPROC_PER_NODE": "2", "NNODES": "2"}, "set MASTER_ADDR to the address of node 0"),
        ({"NPROC_PER_NODE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT must be a TCP port"),
        ({"NNODES": "2"}, "NPROC_PER_NODE is not"),
    ],
)
def test_impossible_launch_layouts_are_refused(env, message):
    with pytest.raises(ValueError, match=message):
        torchrun_command([], env)


def test_impossible_layout_is_a_usage_error_before_launching(capsys, monkeypatch):
    from grpoflow import cli

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NPROC_PER_NODE", "x")
    assert cli.main(["train", "--max_steps", "1"]) == 2
    assert "NPROC_PER_NODE must be a positive integer" in capsys.readouterr().err


def test_launch_only_outside_torchrun():
    assert wants_launch({"NPROC_PER_NODE": "2"})
    assert not wants_launch({"NPROC_PER_NODE": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    assert not wants_launch({})
