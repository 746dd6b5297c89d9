"""A sharded policy's optimizer state saved and loaded in full, so that a checkpoint holds the same
optimizer state as a run without sharding and a resumed run replays exactly.

`full_optimizer_state` hooks the optimizer: its `state_dict()` gathers every sharded state tensor
to a full CPU tensor (a collective: every rank calls it in step; rank 0 writes it), and its
`load_state_dict` takes a full state back, each rank keeping its share. FSDP2's shards are
`DTensor`s sharded on their first dimension; an expert-parallel rank's own experts
(`grpoflow.policy.expert_parallel`) are plain tensors holding its contiguous share of the
experts, gathered and split over the expert-parallel group (`grpoflow.policy.expert_shards`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from grpoflow.policy.expert_shards import gather_share, rank_share


def full_optimizer_state(
    optimizer: torch.optim.Optimizer,
    experts: Sequence[nn.Parameter] = (),
    expert_group: torch_dist.ProcessGroup | None = None,
) -> None:
    """Make `optimizer.state_dict()` hold full CPU tensors in place of its shards (a collective:
    every rank calls it) and `load_state_dict` take them back, each rank keeping its shard.
    `experts`: parameters that are this rank's share of the experts over `expert_group`."""
    own = {id(parameter) for parameter in experts}

    def gather(_optimizer, state_dict: dict) -> dict:
        return _each_state(optimizer, state_dict, lambda value, parameter: _full(value, parameter))

    def scatter(_optimizer, state_dict: dict) -> dict:
        return _each_state(optimizer, state_dict, lambda value, parameter: _share(value, parameter))

    def _full(value: Any, parameter: torch.Tensor) -> Any:
        if hasattr(value, "full_tensor"):
            return value.full_tensor().cpu()
        if id(parameter) in own and isinstance(value, torch.Tensor) and value.shape == parameter.shape:
            return gather_share(value, expert_group).cpu()
        return value

    def _share(value: Any, parameter: torch.Tensor) -> Any:
        if id(parameter) in own and isinstance(value, torch.Tensor) and value.dim() == parameter.dim() > 0:
            return rank_share(value, expert_group).to(parameter.device, parameter.dtype)
        return _local_shard(value, parameter)

    optimizer.register_state_dict_post_hook(gather)
    optimizer.register_load_state_dict_pre_hook(scatter)


def _each_state(
    optimizer: torch.optim.Optimizer, state_dict: dict, convert: Callable[[Any, torch.Tensor], Any]
) -> dict:
    """`state_dict` with each state value `convert`ed, given the parameter it belongs to."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    state = {
        index: {key: convert(value, parameters[index]) for key, value in values.items()}
        for index, values in state_dict["state"].items()
    }
    return {**state_dict, "state": state}


def _local_shard(value: Any, parameter: torch.Tensor) -> Any:
    """This rank's dim-0 shard of the full `value`, as a DTensor laid out like `parameter`."""
    from torch.distributed.tensor import DTensor, Shard

    if (
        not isinstance(parameter, DTensor)
        or not isinstance(value, torch.Tensor)
        or value.shape != parameter.shape
    ):
        return value
    if tuple(parameter.placements) != (Shard(0),):
        raise ValueError(f"optimizer state of a parameter sharded as {parameter.placements} cannot be loaded")
    mesh = parameter.device_mesh
    local = parameter.to_local()
    offset = min(mesh.get_local_rank() * math.ceil(value.shape[0] / mesh.size()), value.shape[0])
    piece = value[offset : offset + local.shape[0]].to(local.device, local.dtype)
    return DTensor.from_local(
        piece, mesh, parameter.placements, shape=parameter.shape, stride=parameter.stride()
    )
