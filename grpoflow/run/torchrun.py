"""Running `grpoflow train` under torchrun, from the environment variables NPROC_PER_NODE, NNODES,
NODE_RANK, MASTER_ADDR and MASTER_PORT (ms-swift's).

With NPROC_PER_NODE (or NNODES) set outside torchrun, `grpoflow train` re-executes itself as
`python -m torch.distributed.run ... -m grpoflow.cli train ARGV`: NPROC_PER_NODE processes on node
NODE_RANK of NNODES, meeting at MASTER_ADDR:MASTER_PORT. The processes torchrun starts carry
LOCAL_RANK and WORLD_SIZE, so they run the training instead of launching again.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Mapping, Sequence

logger = logging.getLogger("grpoflow")

LAUNCH_VARIABLES = ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
"""Environment variables that make `grpoflow train` launch itself under torchrun (ms-swift's)."""


def wants_launch(environ: Mapping[str, str]) -> bool:
    """Whether `grpoflow train` should launch itself under torchrun: NPROC_PER_NODE (or NNODES)
    is set and this process is not already one of torchrun's workers."""
    under_torchrun = "LOCAL_RANK" in environ or "WORLD_SIZE" in environ
    return not under_torchrun and ("NPROC_PER_NODE" in environ or "NNODES" in environ)


def torchrun_command(argv: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The torchrun command that runs `grpoflow train ARGV` on NPROC_PER_NODE processes of node
    NODE_RANK of NNODES, meeting at MASTER_ADDR:MASTER_PORT."""
    if "NPROC_PER_NODE" not in environ:
        raise ValueError("NNODES is set but NPROC_PER_NODE is not: set it to the processes (GPUs) per node")
    nproc = _int(environ, "NPROC_PER_NODE", "", positive=True)
    nnodes = _int(environ, "NNODES", "1", positive=True)
    node_rank = _int(environ, "NODE_RANK", "0")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"NODE_RANK must be in 0 .. NNODES - 1 = {nnodes - 1}, got {node_rank}")
    if nnodes > 1 and "MASTER_ADDR" not in environ:
        raise ValueError(f"NNODES={nnodes}: set MASTER_ADDR to the address of node 0, the same on every node")
    port = _int(environ, "MASTER_PORT", "29500")
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT must be a TCP port in 1 .. 65535, got {port}")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--nnodes",
        str(nnodes),
        "--node_rank",
        str(node_rank),
        "--master_addr",
        environ.get("MASTER_ADDR", "127.0.0.1"),
        "--master_port",
        str(port),
        "-m",
        "grpoflow.cli",
        "train",
        *argv,
    ]


def launch(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """Run `grpoflow train ARGV` under torchrun; its exit status."""
    command = torchrun_command(argv, environ)
    logger.info("launching under torchrun: %s", " ".join(command))
    return subprocess.run(command, check=False).returncode


def _int(environ: Mapping[str, str], name: str, default: str, *, positive: bool = False) -> int:
    text = environ.get(name, default)
    kind = "a positive integer" if positive else "an integer"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be {kind}, got {text!r}") from None
    if positive and value < 1:
        raise ValueError(f"{name} must be {kind}, got {text!r}")
    return value
