"""Run under torchrun with 2 processes (gloo) by tests/policy/test_placement.py: checks of grpoflow.policy.placement
on a sharded tiny model against an unsharded copy of it. Exits non-zero on the first mismatch."""

from __future__ import annotations

import copy

import torch
import torch.distributed as torch_dist

from grpoflow.policy import lora, placement
from grpoflow.policy.lora import AdapterConfig
from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model
from grpoflow.run.distributed import DistributedContext

CPU = torch.device("cpu")


class CopyingEngine:
    """An engine with its own copy of the weights (as vLLM): takes what rollout_weights yields."""

    shares_policy_weights = False


def tiny_model(with_lora: bool = False) -> torch.nn.Module:
    model = build_preset_model("tiny", len(build_char_tokenizer()), seed=3, dtype=torch.float32, device=CPU)
    if with_lora:
        model = lora.add_lora(model, AdapterConfig(lora_rank=4, lora_dropout=0.0))
        with torch.no_grad():  # nonzero adapters, so that a merge changes the weights
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


def train_step(where: placement.Placement, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    from grpoflow.algo import sequence_logprobs

    model = where.module
    rank, world_size = torch_dist.get_rank(), torch_dist.get_world_size()
    rows = ids if not where.is_sharded else ids.chunk(world_size)[rank]
    mask = torch.ones_like(rows)
    logps = where.sharded_forward(lambda: sequence_logprobs(model, rows, mask, logits_to_keep=4)[0])
    logps.sum().backward()
    parameters = [p for p in model.parameters() if p.requires_grad]
    placement.clip_gradients(parameters, 0.5)
    optimizer.step()
    optimizer.zero_grad()


def check_close(got: dict, want: dict, what: str, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys())[:4])
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=f"{what}: {name}")


def main() -> None:
    torch_dist.init_process_group("gloo")
    world_size = torch_dist.get_world_size()
    context = DistributedContext(rank=torch_dist.get_rank(), world_size=world_size)
    ids = torch.randint(0, 30, (4, 12), generator=torch.Generator().manual_seed(0))
    for with_lora, offload_params in ((False, False), (False, True), (True, False)):
        whole = tiny_model(with_lora)
        context.broadcast_parameters(whole)  # LoRA's random initialisation differs between ranks
        sharded = copy.deepcopy(whole)
        where = placement.shard_model(sharded, CPU, world_size=world_size, offload_params=offload_params)
        assert where.module is sharded and where.is_sharded
        what = f"lora={with_lora} offload_params={offload_params}"
        # Built straight after sharding, as launch does. SGD with momentum rather than Adam: the
        # whole model sees one batch of 4 rows where the ranks see 2 each, and Adam would magnify
        # the rounding of near-zero gradients into whole steps.
        optimizers = []
        for model in (whole, sharded):
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizers.append(torch.optim.SGD(trainable, lr=1e-2, momentum=0.9))
        placement.full_optimizer_state(optimizers[1])
        want = {name: tensor.clone() for name, tensor in lora.merged_weights(whole)}
        check_close(dict(where.rollout_weights(CopyingEngine())), want, f"rollout_weights {what}")
        with where.full_parameters(), torch.no_grad():
            inner = lora.generation_model(sharded)
            assert not any(hasattr(p, "full_tensor") for p in inner.parameters()), "unsharded inside"
            got = inner(input_ids=ids).logits
        want_logits = lora.generation_model(whole)(input_ids=ids).logits
        torch.testing.assert_close(got, want_logits, atol=1e-5, rtol=0, msg=f"forward {what}")
        assert all(hasattr(p, "full_tensor") for p in inner.parameters()), "sharded again after the block"

        placements = (placement.Placement.local(whole), where)
        for _ in range(2):
            for model_placement, optimizer in zip(placements, optimizers):
                train_step(model_placement, optimizer, ids)
        state = optimizers[1].state_dict()
        reference = optimizers[0].state_dict()
        for index, values in reference["state"].items():
            for key, value in values.items():
                torch.testing.assert_close(state["state"][index][key], value, atol=1e-5, rtol=0, msg=key)
        full = where.full_state_dict()
        whole_state = {k: v for k, v in whole.state_dict().items() if k in full}
        check_close(full, whole_state, f"state dict after 2 steps {what}", atol=1e-5)
        optimizers[1].load_state_dict(state)
        for model_placement, optimizer in zip(placements, optimizers):
            train_step(model_placement, optimizer, ids)
        full = where.full_state_dict()
        check_close(
            full, {k: v for k, v in whole.state_dict().items() if k in full}, f"after reload {what}", 1e-5
        )
    torch_dist.destroy_process_group()
    print("fsdp worker: all checks passed")


if __name__ == "__main__":
    main()
