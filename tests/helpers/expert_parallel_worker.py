"""Run under torchrun with 2 processes (gloo) by tests/policy/test_expert_parallel.py: the tiny
Qwen3-MoE with its experts split over both ranks (grpoflow.policy.expert_parallel), each rank on
half of the batch, against the whole model on the whole batch. Exits non-zero on the first
mismatch."""

from __future__ import annotations

import copy

import torch
import torch.distributed as torch_dist

from grpoflow.policy.expert_parallel import expert_parameters, shard_experts
from grpoflow.policy.routing_replay import RoutingRecord, moe_routers
from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model

ROWS, COLUMNS = 4, 10
NUM_EXPERTS, TOP_K, LAYERS = 8, 2, 2


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    """A loss that weighs every logit differently (the same weights for the same row everywhere)."""
    weights = torch.randn(ROWS, *logits.shape[1:], generator=torch.Generator().manual_seed(5))
    rows = (
        weights.chunk(torch_dist.get_world_size())[torch_dist.get_rank()] if len(logits) < ROWS else weights
    )
    return (logits * rows).sum()


def forward(model: torch.nn.Module, ids: torch.Tensor, routed: torch.Tensor | None) -> torch.Tensor:
    """Logits of `ids`, replaying `routed` (tokens, layers, top_k) when given."""
    record = RoutingRecord(replay=routed is not None)
    with moe_routers(model).hooked(record):
        record.bind(routed, None)
        logits = model(input_ids=ids).logits
        loss_of(logits).backward()
    if routed is not None:
        assert record.mismatch_fraction() is not None
    return logits.detach()


def check_case(name: str, routed: torch.Tensor | None, grouped: bool, checkpointing: bool = False) -> None:
    rank, size = torch_dist.get_rank(), torch_dist.get_world_size()
    whole = build_preset_model("tiny-moe", len(build_char_tokenizer()), seed=7)
    split = copy.deepcopy(whole)
    assert shard_experts(split, torch_dist.group.WORLD, grouped=grouped) == LAYERS
    if checkpointing:
        for model in (whole, split):
            model.gradient_checkpointing_enable({"use_reentrant": False})
            model.train()
    ids = torch.randint(3, 60, (ROWS, COLUMNS), generator=torch.Generator().manual_seed(11))
    want = forward(whole, ids, routed)
    mine = slice(rank * ROWS // size, (rank + 1) * ROWS // size)
    local_routed = (
        None if routed is None else routed.view(ROWS, COLUMNS, LAYERS, TOP_K)[mine].reshape(-1, LAYERS, TOP_K)
    )
    got = forward(split, ids[mine], local_routed)
    torch.testing.assert_close(got, want[mine], atol=1e-5, rtol=1e-5, msg=f"{name}: logits")

    experts = {id(parameter) for parameter in expert_parameters(split)}
    whole_parameters = dict(whole.named_parameters())
    for parameter_name, parameter in split.named_parameters():
        grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        reference = whole_parameters[parameter_name].grad
        if id(parameter) in experts:
            first = rank * NUM_EXPERTS // size
            reference = reference[first : first + NUM_EXPERTS // size]
        else:
            grad = grad.clone()
            torch_dist.all_reduce(grad)
        torch.testing.assert_close(grad, reference, atol=1e-5, rtol=1e-5, msg=f"{name}: {parameter_name}")


def on_one_rank(layer_owners: tuple[int, int]) -> torch.Tensor:
    """Routing where every token of layer l goes to two experts of rank `layer_owners[l]`, the
    token's own pair varying along the batch."""
    tokens = ROWS * COLUMNS
    routed = torch.empty(tokens, LAYERS, TOP_K, dtype=torch.long)
    local = NUM_EXPERTS // torch_dist.get_world_size()
    for layer, owner in enumerate(layer_owners):
        first = torch.arange(tokens) % local
        routed[:, layer, 0] = owner * local + first
        routed[:, layer, 1] = owner * local + (first + 1) % local
    return routed


def main() -> None:
    torch_dist.init_process_group("gloo")
    torch.manual_seed(0)
    check_case("own routing, loop", None, grouped=False)
    check_case("own routing, grouped products", None, grouped=True)
    check_case("own routing, gradient checkpointing", None, grouped=False, checkpointing=True)
    # Layer 0 sends every token to rank 0's experts (rank 1 receives none), layer 1 to rank 1's.
    check_case("all on one rank", on_one_rank((0, 1)), grouped=False)
    check_case("all on one rank, grouped products", on_one_rank((1, 0)), grouped=True)
    torch_dist.barrier()
    if torch_dist.get_rank() == 0:
        print("all checks passed")
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
