"""Expert parallelism for a mixture-of-experts policy's training forward: each rank of an expert
parallel (EP) group keeps only its share of every MoE layer's experts, and tokens travel to the
experts that score them.

`shard_experts(model, group)` makes each sparse block's `experts` module (transformers'
Qwen3-MoE layout: fused `gate_up_proj` (E, 2I, H), gate rows first, and `down_proj` (E, H, I))
an `ExpertParallelExperts` in place, holding the contiguous experts `rank * E / size` up to
`(rank + 1) * E / size` of the group's `size` ranks under the same parameter names. The block
still runs its router (so routing replay, the mismatch count and the load-balancing loss see it as
before, `routing_replay`) and hands the chosen experts and their weights to the experts module,
which then:

1. sorts its (token, expert) pairs by expert, hence by the rank that owns the expert, and
   exchanges the per-expert counts with every rank (one `all_to_all_single` of E integers);
2. sends each pair's hidden state to its expert's rank (`all_to_all_single`, uneven splits);
3. runs its local experts over what it received, sorted by expert, as two grouped products
   (`torch._grouped_mm` where `grouped_mm_runs` says it does, through `kernels.ops.grouped_linear`,
   whose backward gives an expert that received no rows a zero gradient on every GPU; else a loop
   over the experts with the products transformers' eager loop computes);
4. returns each result to the rank it came from (the reverse `all_to_all_single`) and adds the
   results to their tokens weighted by the routing weights in ascending expert order, as
   transformers' eager loop does.

While the module holds every expert (inside `expert_shards.gathered_experts`, around a rollout)
it runs the same products on this rank alone, with no exchange: a forward there is the rank's own
(as a forward of FSDP's gathered units is), such as the on-policy replay's.

Both exchanges are differentiable: the backward pass of each sends the gradients back along the
reverse exchange, so every rank's expert gradients are summed over all the group's tokens, as a
single process on the whole batch would have them. Every rank of the group must run the same
forward and backward passes (each MoE layer is a collective), also one that holds no tokens for
some expert or receives none at all. The other parameters stay whole on each rank: their
gradients are reduced over the group as under plain data parallelism (or by FSDP with
`expert_parameters` left out of its units).

The experts compute in the dtype of the hidden states they receive: under FSDP's bfloat16 mixed
precision with float32 weights (the experts left out of its units), their float32 shard is cast
for each forward, as FSDP casts the parameters it gathers, and their gradients stay float32.

Expert-parallel experts keep only their shard: saving a checkpoint or syncing weights to a
rollout engine gathers the full experts first (`grpoflow.policy.expert_shards`).
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn

from grpoflow.kernels.ops import grouped_linear, grouped_mm_runs
from grpoflow.models.moe import is_sparse, sparse_refusal
from grpoflow.models.moe_adapters import base_experts

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The fused expert parameters each rank keeps a share of (first dimension: the experts)."""


class ExpertParallelExperts(nn.Module):
    """One MoE layer's experts under expert parallelism: this rank's contiguous share of the
    fused expert weights, called as transformers' experts module is
    (`hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)`).

    `shard_experts` makes a model's experts modules into this class in place (as FSDP2's
    `fully_shard` does with the modules it shards): each keeps its identity, its attributes and
    its parameters' names, so whatever holds the module (a rollout engine built before) sees the
    shards, or the full weights inside `gathered_experts`."""

    group: torch_dist.ProcessGroup
    size: int
    num_experts: int
    local_experts: int
    first_expert: int
    """The global index of this rank's first expert."""
    grouped: bool | None
    """Grouped products (`torch._grouped_mm`); None: where `grouped_mm_runs` says they run."""

    def _keep_share(self, group: torch_dist.ProcessGroup, grouped: bool | None) -> None:
        """Replace the full fused weights by this rank's share of them."""
        num_experts = self.gate_up_proj.shape[0]
        size, rank = torch_dist.get_world_size(group), torch_dist.get_rank(group)
        local = num_experts // size
        self.group, self.size, self.num_experts = group, size, num_experts
        self.local_experts, self.first_expert, self.grouped = local, rank * local, grouped
        share = slice(self.first_expert, self.first_expert + local)
        for name in EXPERT_WEIGHTS:
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full.detach()[share].clone(), requires_grad=full.requires_grad))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        top_k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.gate_up_proj.shape[0] == self.num_experts:  # gathered: this rank's own pass
            results = self.local_products(hidden_states[order // top_k], counts)
            weighted = results * top_k_weights.reshape(-1)[order, None]
            return torch.zeros_like(hidden_states).index_add(
                0, order // top_k, weighted.to(hidden_states.dtype)
            )
        received = torch.empty_like(counts)
        torch_dist.all_to_all_single(received, counts, group=self.group)
        sent = counts.view(self.size, self.local_experts).sum(dim=1).tolist()
        received = received.view(self.size, self.local_experts)
        arrived = received.sum(dim=1).tolist()
        rows = all_to_all(hidden_states[order // top_k], arrived, sent, self.group)
        # Arrived rows come by source rank, then by expert: sort them by expert alone.
        experts = torch.arange(self.local_experts, device=rows.device).repeat(self.size)
        by_expert = torch.argsort(experts.repeat_interleave(received.reshape(-1)), stable=True)
        products = self.local_products(rows[by_expert], received.sum(dim=0))
        results = all_to_all(products[torch.argsort(by_expert)], sent, arrived, self.group)
        weighted = results * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add(0, order // top_k, weighted.to(hidden_states.dtype))

    def local_products(self, rows: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """Each row (sorted by local expert, `per_expert` rows each) through its expert's MLP, the
        weights cast to the rows' dtype (as FSDP's mixed precision casts the other parameters)."""
        gate_up, down = self.gate_up_proj.to(rows.dtype), self.down_proj.to(rows.dtype)
        grouped = self.grouped if self.grouped is not None else grouped_mm_runs(rows.device, rows.dtype)
        if grouped and len(rows):  # nothing arrived: the loop's empty products still reach every expert
            offsets = per_expert.cumsum(dim=0).to(torch.int32)
            gate, up = grouped_linear(rows, gate_up, offsets, use_grouped_mm=True).chunk(2, dim=-1)
            return grouped_linear(self.act_fn(gate) * up, down, offsets, use_grouped_mm=True)
        pieces = []
        for expert, part in enumerate(rows.split(per_expert.tolist())):
            gate, up = F.linear(part, gate_up[expert]).chunk(2, dim=-1)
            pieces.append(F.linear(self.act_fn(gate) * up, down[expert]))
        return torch.cat(pieces)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits whose backward pass is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, arrived: list[int], sent: list[int], group) -> torch.Tensor:
        ctx.arrived, ctx.sent, ctx.group = arrived, sent, group
        output = rows.new_empty((sum(arrived), *rows.shape[1:]))
        torch_dist.all_to_all_single(output, rows.contiguous(), arrived, sent, group=group)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        torch_dist.all_to_all_single(output, grad.contiguous(), ctx.sent, ctx.arrived, group=ctx.group)
        return output, None, None, None


def all_to_all(rows: torch.Tensor, arrived: list[int], sent: list[int], group) -> torch.Tensor:
    """`rows` split `sent[r]` to rank r, gathered as `arrived[r]` rows from rank r (differentiable)."""
    return _AllToAll.apply(rows, arrived, sent, group)


def expert_parallel_refusal(model: nn.Module, size: int) -> str | None:
    """Why `model`'s experts cannot be split over `size` ranks by `shard_experts`; None if they can."""
    config = getattr(model, "config", None)
    blocks = sparse_blocks(model)
    if not blocks:
        return f"{type(model).__name__} has no sparse MoE blocks (an MLP with a router and experts)"
    for name, block in blocks:
        if base_experts(block.experts) is not block.experts:
            return f"{name}.experts carries LoRA adapters (expert parallelism splits plain experts)"
        reason = sparse_refusal(block, config)
        if reason is not None:
            return f"{name}: {reason}"
        num_experts = block.experts.gate_up_proj.shape[0]
        if num_experts % size:
            return f"{name} has {num_experts} experts, which {size} ranks cannot share evenly"
    return None


def sparse_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, module) of each sparse MoE block of `model` (an MLP with a router and experts)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if is_sparse(module) and hasattr(module, "gate")
    ]


def shard_experts(model: nn.Module, group: torch_dist.ProcessGroup, grouped: bool | None = None) -> int:
    """Keep on this rank only its share of every sparse block's experts, exchanged over `group`
    in the forward and backward passes (every rank of `group` calls this with the same weights);
    the number of blocks changed. `grouped` as `ExpertParallelExperts.grouped`."""
    size = torch_dist.get_world_size(group)
    reason = expert_parallel_refusal(model, size)
    if reason is not None:
        raise ValueError(
            f"expert parallelism over {size} ranks cannot split this model: {reason}; "
            "set expert_model_parallel_size: 1"
        )
    blocks = sparse_blocks(model)
    for _, block in blocks:
        experts = block.experts
        experts.__class__ = _expert_parallel_class(type(experts))
        experts._keep_share(group, grouped)
    return len(blocks)


_CLASSES: dict[type, type] = {}


def _expert_parallel_class(base: type) -> type:
    """The `ExpertParallelExperts` subclass of the experts class `base` (one per class)."""
    if issubclass(base, ExpertParallelExperts):
        return base
    if base not in _CLASSES:
        _CLASSES[base] = type(f"ExpertParallel{base.__name__}", (ExpertParallelExperts, base), {})
    return _CLASSES[base]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel experts' parameters of `model` (each rank's own shard: left out of any
    gradient reduction over the group, whose tokens they have already seen)."""
    return [
        parameter
        for module in model.modules()
        if isinstance(module, ExpertParallelExperts)
        for parameter in module.parameters()
    ]
