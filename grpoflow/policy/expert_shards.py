"""Expert-parallel experts (`grpoflow.policy.expert_parallel`) in the placement's other jobs: the
full experts for a rollout engine that reads the policy in place and for checkpoints, the
gradient norm over every rank's share, and the optimizer state saved and loaded in full.

Each rank of the expert-parallel group holds its contiguous share of every expert parameter (the
first dimension: the experts, in rank order), so a parameter's full tensor is every rank's share
concatenated in rank order: one all-gather over the group, one parameter at a time, so that no
more than one parameter's full tensor is in flight beyond what the caller keeps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as torch_dist
from torch import nn

from grpoflow.policy.expert_parallel import EXPERT_WEIGHTS, ExpertParallelExperts
from grpoflow.policy.lora import whole


def gather_share(share: torch.Tensor, group: torch_dist.ProcessGroup) -> torch.Tensor:
    """The full tensor of which each rank of `group` holds the dim-0 share `share`, in rank order
    (a collective every rank calls in step), on `share`'s device."""
    size = torch_dist.get_world_size(group)
    parts = [torch.empty_like(share) for _ in range(size)]
    torch_dist.all_gather(parts, share.detach().contiguous(), group=group)
    return torch.cat(parts)


def rank_share(full: torch.Tensor, group: torch_dist.ProcessGroup) -> torch.Tensor:
    """This rank's contiguous dim-0 share of `full` among the ranks of `group` (a copy)."""
    size, rank = torch_dist.get_world_size(group), torch_dist.get_rank(group)
    local = full.shape[0] // size
    return full[rank * local : (rank + 1) * local].clone()


def expert_modules(model: nn.Module) -> list[tuple[str, ExpertParallelExperts]]:
    """The (name, module) of each expert-parallel experts module of `model`."""
    return [
        (name, module) for name, module in model.named_modules() if isinstance(module, ExpertParallelExperts)
    ]


@contextmanager
def gathered_experts(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[None]:
    """Within the block every expert-parallel experts module of `model` holds every expert: its
    full weights, gathered layer by layer (in `dtype`, as FSDP's mixed precision gathers the other
    parameters; None: their own), registered in place of the shares as parameters without
    gradients (so that an engine reading the module sees them, and notices new tensors); leaving,
    the shares again. A collective every rank enters in step."""
    kept: list[tuple[ExpertParallelExperts, dict[str, nn.Parameter]]] = []
    try:
        with torch.no_grad():
            for _, module in expert_modules(model):
                shares = {name: getattr(module, name) for name in EXPERT_WEIGHTS}
                kept.append((module, shares))
                for name, share in shares.items():
                    full = gather_share(share.to(dtype or share.dtype), module.group)
                    setattr(module, name, nn.Parameter(full, requires_grad=False))
        yield
    finally:
        for module, shares in kept:
            for name, share in shares.items():
                setattr(module, name, share)


def full_expert_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each expert-parallel parameter of `model` by its state-dict name, gathered in full and
    copied to the CPU one at a time (a collective every rank walks to the end in step)."""
    for module_name, module in expert_modules(model):
        for name in EXPERT_WEIGHTS:
            yield f"{module_name}.{name}", gather_share(getattr(module, name), module.group).cpu()


def clip_gradients(
    parameters: Sequence[nn.Parameter], max_norm: float, group: torch_dist.ProcessGroup
) -> torch.Tensor:
    """Clip the gradients of `parameters` by their global norm, as a plain tensor: FSDP's sharded
    ones (DTensors) by the norm of their full gradients, the others, each rank's own experts (whose
    gradients are complete on their rank), by their squares summed over `group`; every gradient
    is then scaled by the one coefficient `clip_grad_norm_` would take."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [grad for grad in grads if isinstance(grad, DTensor)]
    own = [grad for grad in grads if not isinstance(grad, DTensor)]
    device = (own or [torch.zeros(())])[0].device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    if own:  # every rank holds experts with gradients, or none does
        squares = torch.stack([norm.float() for norm in torch._foreach_norm(own)]).square().sum()
        torch_dist.all_reduce(squares, group=group)
    if sharded:
        squares = squares + whole(torch.nn.utils.get_total_norm(sharded)).float().to(device).square()
    total = squares.sqrt()
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    locals_ = [grad.to_local() for grad in sharded] + own
    for kind in {(grad.device, grad.dtype) for grad in locals_}:
        same = [grad for grad in locals_ if (grad.device, grad.dtype) == kind]
        torch._foreach_mul_(same, coefficient.to(*kind))
    return total
