"""Run under torchrun with 2 processes by tests/policy/test_expert_parallel.py: the tiny Qwen3-MoE
with its experts split over both ranks (grpoflow.policy.expert_parallel), each rank on half of the
batch, against the whole model on the whole batch. On the CPU (gloo) everything runs in float32;
with `--cuda` (NCCL, one GPU a rank) the looped products run in float32 and the grouped ones
(`torch._grouped_mm`) in bfloat16, replaying the whole model's own routing so that rounding picks
no other expert. Exits non-zero on the first mismatch."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as torch_dist
from moe import own_routing  # tests/helpers/moe.py: the worker runs as a script from this folder

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native.engine import NativeEngine
from grpoflow.policy import placement
from grpoflow.policy.expert_parallel import ExpertParallelExperts, expert_parameters, shard_experts
from grpoflow.policy.routing_replay import RoutingRecord, moe_routers
from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model

ROWS, COLUMNS = 4, 10
NUM_EXPERTS, TOP_K, LAYERS = 8, 2, 2
DEVICE = torch.device("cpu")


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    """A loss that weighs every logit differently (the same weights for the same row everywhere)."""
    weights = torch.randn(ROWS, *logits.shape[1:], generator=torch.Generator().manual_seed(5))
    if len(logits) < ROWS:
        weights = weights.chunk(torch_dist.get_world_size())[torch_dist.get_rank()]
    return (logits.float() * weights.to(DEVICE)).sum()


def forward(model: torch.nn.Module, ids: torch.Tensor, routed: torch.Tensor | None) -> torch.Tensor:
    """Logits of `ids` after the backward pass of `loss_of`, replaying `routed` (tokens, layers,
    top_k) when given."""
    record = RoutingRecord(replay=routed is not None)
    with moe_routers(model).hooked(record):
        record.bind(routed, None)
        logits = model(input_ids=ids).logits
        loss_of(logits).backward()
    if routed is not None:
        assert record.mismatch_fraction() is not None
    return logits.detach()


def check_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal to float32 tolerance, or in bfloat16 within 2% of the norm."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=what)
        return
    error = (got.float() - want.float()).norm()
    assert error <= 2e-2 * want.float().norm() + 1e-3, (what, float(error), float(want.float().norm()))


def check_case(name: str, routing, grouped: bool, checkpointing: bool = False) -> None:
    """`routing`: None (the router's own choice), "own" (the whole model's choice replayed) or a
    (tokens, layers, top_k) routing to replay."""
    rank, size = torch_dist.get_rank(), torch_dist.get_world_size()
    dtype = torch.bfloat16 if grouped and DEVICE.type == "cuda" else torch.float32
    whole = build_preset_model("tiny-moe", len(build_char_tokenizer()), seed=7, dtype=dtype, device=DEVICE)
    split = copy.deepcopy(whole)
    assert shard_experts(split, torch_dist.group.WORLD, grouped=grouped) == LAYERS
    if checkpointing:
        for model in (whole, split):
            model.gradient_checkpointing_enable({"use_reentrant": False})
            model.train()
    ids = torch.randint(3, 60, (ROWS, COLUMNS), generator=torch.Generator().manual_seed(11)).to(DEVICE)
    routed = own_routing(whole, ids) if routing == "own" else routing
    want = forward(whole, ids, routed)
    mine = slice(rank * ROWS // size, (rank + 1) * ROWS // size)
    if routed is not None:
        routed = routed.view(ROWS, COLUMNS, LAYERS, TOP_K)[mine].reshape(-1, LAYERS, TOP_K)
    check_close(forward(split, ids[mine], routed), want[mine], f"{name}: logits")

    experts = {id(parameter) for parameter in expert_parameters(split)}
    whole_parameters = dict(whole.named_parameters())
    for parameter_name, parameter in split.named_parameters():
        grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        reference = whole_parameters[parameter_name].grad
        if id(parameter) in experts:
            first = rank * NUM_EXPERTS // size
            reference = reference[first : first + NUM_EXPERTS // size]
        else:
            grad = grad.float()
            torch_dist.all_reduce(grad)
        check_close(grad.to(reference.dtype), reference, f"{name}: {parameter_name}")


def check_mixed_precision() -> None:
    """Float32 experts under bfloat16 hidden states (FSDP's bf16 mixed precision) compute in
    bfloat16, as the float32 products rounded, and keep float32 gradients."""
    model = build_preset_model("tiny-moe", len(build_char_tokenizer()), seed=7, device=DEVICE)
    shard_experts(model, torch_dist.group.WORLD, grouped=False)
    experts = model.model.layers[0].mlp.experts
    hidden = torch.randn(12, 64, generator=torch.Generator().manual_seed(torch_dist.get_rank())).to(DEVICE)
    chosen = torch.arange(24, device=DEVICE).view(12, 2) % NUM_EXPERTS
    weights = torch.full((12, 2), 0.5, device=DEVICE)
    want = experts(hidden, chosen, weights)
    got = experts(hidden.bfloat16(), chosen, weights.bfloat16())
    assert got.dtype == torch.bfloat16, got.dtype
    check_close(got, want.bfloat16(), "bf16 hidden states: output")
    got.float().sum().backward()
    assert experts.gate_up_proj.grad.dtype == torch.float32


def check_engine_reads_every_expert() -> None:
    """A native engine built on the policy before its placement (as a run builds it) generates,
    inside the rollout context of the policy's experts split beside FSDP, from every expert's
    current weights: the same tokens as an engine on the whole model with the same weights. Out of
    the context the experts hold their shares again, and a checkpoint's state dict all of them.
    FSDP's mixed precision off: the policy computes in float32 as the whole model does."""
    rank, size = torch_dist.get_rank(), torch_dist.get_world_size()
    whole = build_preset_model("tiny-moe", len(build_char_tokenizer()), seed=7, device=DEVICE)
    split = copy.deepcopy(whole)
    engine = NativeEngine(split)
    assert engine.path == "family"
    where = placement.shard_model(split, DEVICE, world_size=size, precision="no", expert_parallel=True)
    local = NUM_EXPERTS // size
    with torch.no_grad():  # each rank moves its own experts, and the whole model's copies of them
        for module in split.modules():
            if isinstance(module, ExpertParallelExperts):
                assert module.gate_up_proj.shape[0] == local and not hasattr(
                    module.gate_up_proj, "full_tensor"
                )
        whole_modules = dict(whole.named_modules())
        for name, module in split.named_modules():
            if isinstance(module, ExpertParallelExperts):
                for weight in ("gate_up_proj", "down_proj"):
                    full = getattr(whole_modules[name], weight)
                    for owner in range(size):
                        delta = torch.randn(
                            full[:local].shape, generator=torch.Generator().manual_seed(owner)
                        )
                        full[owner * local : (owner + 1) * local] += delta.to(DEVICE) * 0.5
                    getattr(module, weight).copy_(full[rank * local : (rank + 1) * local])
    prompts = [[5, 9, 14, 3], [7, 7, 21]]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    want = NativeEngine(whole).generate(prompts, params)
    with where.rollout_context(engine):
        for name, module in split.named_modules():
            if isinstance(module, ExpertParallelExperts):
                for weight in ("gate_up_proj", "down_proj"):
                    got = getattr(module, weight)
                    torch.testing.assert_close(got, getattr(whole_modules[name], weight), atol=0, rtol=0)
        got = engine.generate(prompts, params)
        # A forward there is this rank's own (no exchange): ranks may run different ones.
        ids = torch.arange(3, 3 + 5 * (rank + 1), device=DEVICE).view(1, -1)
        with torch.no_grad():
            own = split(input_ids=ids).logits
        torch.testing.assert_close(own, whole(input_ids=ids).logits.detach(), atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(got, want, strict=True):
        assert [c.token_ids for c in mine] == [c.token_ids for c in theirs], (mine, theirs)
    assert all(p.shape[0] == local for p in expert_parameters(split)), "the shares are back"
    state = where.full_state_dict()  # what rank 0 writes
    if rank == 0:
        want_state = whole.state_dict()
        assert state.keys() == want_state.keys() - {"lm_head.weight"}  # tied: saved once
        for name, tensor in state.items():
            torch.testing.assert_close(tensor, want_state[name].cpu(), atol=0, rtol=0, msg=name)


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
    return routed.to(DEVICE)


def grouped_products_run() -> bool:
    """Whether `torch._grouped_mm` multiplies float32 on the CPU (or bfloat16 on a GPU) here."""
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    try:
        rows, weights = (
            torch.ones(16, 16, dtype=dtype, device=DEVICE),
            torch.ones(2, 16, 16, dtype=dtype, device=DEVICE),
        )
        torch._grouped_mm(rows, weights, offs=torch.tensor([8, 16], dtype=torch.int32, device=DEVICE))
    except (AttributeError, RuntimeError):
        return False
    return True


def main() -> None:
    global DEVICE
    if "--cuda" in sys.argv:
        DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(DEVICE)
    torch_dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo")
    torch.manual_seed(0)
    own = "own" if DEVICE.type == "cuda" else None
    check_case("own routing, loop", None, grouped=False)
    check_case("own routing, gradient checkpointing", None, grouped=False, checkpointing=True)
    # Layer 0 sends every token to rank 0's experts (rank 1 receives none), layer 1 to rank 1's.
    check_case("all on one rank", on_one_rank((0, 1)), grouped=False)
    check_mixed_precision()
    check_engine_reads_every_expert()
    if grouped_products_run():
        check_case("own routing, grouped products", own, grouped=True)
        check_case("all on one rank, grouped products", on_one_rank((1, 0)), grouped=True)
    elif torch_dist.get_rank() == 0:
        print(f"torch._grouped_mm does not run on {DEVICE.type} here: grouped products unchecked")
    torch_dist.barrier()
    if torch_dist.get_rank() == 0:
        print("all checks passed")
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
