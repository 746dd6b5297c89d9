"""Run under torchrun with 2 processes (gloo) by tests/policy/test_placement.py: checks of grpoflow.policy.placement
on a sharded tiny model against an unsharded copy of it. Exits non-zero on the first mismatch."""

from __future__ import annotations

import copy

import torch
import torch.distributed as torch_dist

from grpoflow.distributed import DistributedContext
from grpoflow.engines import EngineCapabilities
from grpoflow.policy import lora, optimizer_state, placement, sharded_weights
from grpoflow.policy.lora import AdapterConfig
from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model
from grpoflow.transport.adapters import DOWN, UP, is_adapter_name

CPU = torch.device("cpu")


class CopyingEngine:
    """An engine with its own copy of the weights (as vLLM): takes what rollout_weights yields."""

    capabilities = EngineCapabilities(name="copying")
    shares_policy_weights = False


class SharingEngine:
    """An engine that reads the policy's own parameters (as the native engine)."""

    capabilities = EngineCapabilities(name="sharing", applies_adapters=True)
    shares_policy_weights = True


class AdapterEngine:
    """An engine with its own copy that adds a LoRA policy's adapters to the base it holds (as
    `grpoflow serve` or colocated vLLM with adapters), or that takes merged weights only."""

    shares_policy_weights = False

    def __init__(self, accepts_adapters: bool = True, holds_base: bool = False) -> None:
        self.capabilities = EngineCapabilities(name="adapter", accepts_adapters=accepts_adapters)
        self.holds_base = holds_base


def tiny_model(with_lora: bool = False, modules_to_save: tuple[str, ...] = ()) -> torch.nn.Module:
    model = build_preset_model("tiny", len(build_char_tokenizer()), seed=3, dtype=torch.float32, device=CPU)
    if with_lora:
        config = AdapterConfig(lora_rank=4, lora_dropout=0.0, modules_to_save=list(modules_to_save))
        model = lora.add_lora(model, config)
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


def check_equal(got: list, want: list, what: str) -> None:
    """The same (name, tensor) pairs, in any order, equal bit for bit."""
    got_by_name, want_by_name = dict(got), dict(want)
    assert len(got_by_name) == len(got), (what, "a name given twice")
    assert got_by_name.keys() == want_by_name.keys(), (
        what,
        sorted(got_by_name.keys() ^ want_by_name.keys())[:4],
    )
    for name, tensor in want_by_name.items():
        assert got_by_name[name].device == CPU, (what, name)
        assert torch.equal(got_by_name[name], tensor.detach()), (what, name)


def gathering_units(run) -> list:
    """The FSDP units `sharded_weights` gathers while `run()` walks, in order, and its result."""
    gathered, unsharded = [], sharded_weights.unsharded

    def recording(unit):
        gathered.append(unit)
        return unsharded(unit)

    sharded_weights.unsharded = recording
    try:
        return gathered, run()
    finally:
        sharded_weights.unsharded = unsharded


def check_adapter_sync(context: DistributedContext, ids: torch.Tensor) -> None:
    """An engine that accepts adapters gets from the sharded policy the unmerged base with the
    adapters, then the adapters and `modules_to_save` alone, as from the whole policy; one that
    does not gets the merged weights."""
    world_size = context.world_size
    whole = tiny_model(with_lora=True, modules_to_save=("model.norm",))
    context.broadcast_parameters(whole)
    with torch.no_grad():  # a trained copy of the norm that differs from the base's
        for name, parameter in whole.named_parameters():
            if "modules_to_save" in name:
                parameter.add_(0.5)
    sharded = copy.deepcopy(whole)
    where = placement.shard_model(sharded, CPU, world_size=world_size)
    engine = AdapterEngine()
    first = list(where.rollout_weights(engine))
    check_equal(first, list(lora.adapter_update(whole, with_base=True)), "first sync")
    # The base part: the plain model's parameters by their plain names, unmerged (the trained
    # modules_to_save in place of its base); the adapters under their wire names only.
    plain = dict(tiny_model().named_parameters())
    base = {name: tensor for name, tensor in first if not is_adapter_name(name)}
    assert base.keys() == plain.keys(), sorted(base.keys() ^ plain.keys())[:4]
    trained_norm = whole.get_base_model().model.norm.modules_to_save["default"].weight
    for name, tensor in base.items():
        want = trained_norm if name == "model.norm.weight" else plain[name]
        assert torch.equal(tensor, want.detach()), f"first sync base {name}"
    merged = dict(lora.merged_weights(whole))
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(base[q_proj], merged[q_proj].detach()), "the base came merged"
    peft_layers = [
        name for name, module in whole.get_base_model().named_modules() if hasattr(module, "lora_A")
    ]
    adapters = {name for name, _ in first if is_adapter_name(name)}
    assert adapters == {f"{layer}{suffix}" for layer in peft_layers for suffix in (DOWN, UP)}
    assert not any(".base_layer." in name or ".default." in name for name, _ in first)

    engine.holds_base = True
    gathered, later = gathering_units(lambda: list(where.rollout_weights(engine)))
    check_equal(later, list(lora.adapter_update(whole, with_base=False)), "adapter sync")
    assert {name for name, _ in later} == adapters | {"model.norm.weight"}
    layer = whole.get_base_model().model.layers[1].mlp.down_proj
    up = dict(later)[f"model.layers.1.mlp.down_proj{UP}"]
    assert torch.equal(up, layer.lora_B["default"].weight.detach() * 32 / 4), "B scaled by alpha / r"
    assert gathered == [], "the adapters and the trained norm are gathered tensor by tensor, no unit"
    merging = AdapterEngine(accepts_adapters=False, holds_base=True)
    check_close(
        dict(where.rollout_weights(merging)), dict(lora.merged_weights(whole)), "merged for any other"
    )

    # After training steps the adapters and the norm move; the sync follows them.
    optimizers = []
    for model in (whole, sharded):
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizers.append(torch.optim.SGD(trainable, lr=1e-2, momentum=0.9))
    for _ in range(2):
        for model_placement, optimizer in zip((placement.Placement.local(whole), where), optimizers):
            train_step(model_placement, optimizer, ids)
    trained = dict(lora.adapter_update(whole, with_base=False))
    assert not torch.equal(trained["model.norm.weight"], dict(later)["model.norm.weight"]), "trained"
    check_close(dict(where.rollout_weights(engine)), trained, "adapter sync after 2 steps", atol=1e-5)


def check_adapter_sync_gathers_units_only_with_the_base(context: DistributedContext) -> None:
    """The first sync gathers every unit (the base goes too); an adapter-only one none (each
    adapter tensor is gathered by itself), unless the shards live off the mesh's device."""
    whole = tiny_model(with_lora=True)
    context.broadcast_parameters(whole)
    where = placement.shard_model(copy.deepcopy(whole), CPU, world_size=context.world_size)
    gathered, first = gathering_units(lambda: list(where.rollout_weights(AdapterEngine())))
    assert gathered == where.units
    check_equal(first, list(lora.adapter_update(whole, with_base=True)), "first sync without modules_to_save")
    gathered, later = gathering_units(lambda: list(where.rollout_weights(AdapterEngine(holds_base=True))))
    assert gathered == []
    assert all(is_adapter_name(name) for name, _ in later)
    check_equal(later, list(lora.adapter_update(whole, with_base=False)), "adapters without modules_to_save")
    # Shards off the mesh's device (CPU-offloaded under a GPU mesh, which a CPU test cannot build):
    # the units holding adapters are gathered, not the root, which holds none.
    assert sharded_weights._shards_where_they_compute(where.units[1])
    on_mesh_device, sharded_weights._shards_where_they_compute = (
        sharded_weights._shards_where_they_compute,
        (lambda unit: False),
    )
    try:
        gathered, later = gathering_units(lambda: list(where.rollout_weights(AdapterEngine(holds_base=True))))
    finally:
        sharded_weights._shards_where_they_compute = on_mesh_device
    assert gathered == where.units[1:] == list(placement.decoder_layers(where.module))
    check_equal(later, list(lora.adapter_update(whole, with_base=False)), "adapters of offloaded shards")


def check_no_grad_passes_leave_every_unit_sharded(context: DistributedContext, ids: torch.Tensor) -> None:
    """Without reshard-after-forward a layer keeps its gathered weights for a backward pass; a
    no-grad pass has none, so every unit is sharded again after it (else the next optimizer step
    would update shards the gathered copies hide); inside full_parameters nothing is."""
    model = tiny_model(False)
    context.broadcast_parameters(model)
    where = placement.shard_model(model, CPU, world_size=context.world_size, reshard_after_forward=False)
    with torch.no_grad():
        where.sharded_forward(lambda: model(input_ids=ids))
    assert all(hasattr(p, "full_tensor") for p in model.parameters()), "a unit stayed gathered"
    with where.full_parameters(), torch.no_grad():
        where.sharded_forward(lambda: model(input_ids=ids))
        assert not any(hasattr(p, "full_tensor") for p in model.parameters()), "resharded inside"
    assert all(hasattr(p, "full_tensor") for p in model.parameters())


def check_kept_gathered_across_micro_batches(context: DistributedContext, ids: torch.Tensor) -> None:
    """Without reshard-after-forward the layers keep their gathered weights from one micro-batch's
    backward pass to the next micro-batch (no second all-gather), and the step's last backward
    pass shards them again, before the optimizer writes the shards."""
    model = tiny_model(False)
    context.broadcast_parameters(model)
    where = placement.shard_model(
        model, CPU, world_size=context.world_size, reshard_after_forward=False, reduce_every_micro_batch=False
    )
    layers = placement.decoder_layers(model)
    for last in (False, False, True):
        where.sync_gradients(last=last)
        where.sharded_forward(lambda: model(input_ids=ids).logits.square().mean()).backward()
        gathered = not any(hasattr(p, "full_tensor") for p in layers.parameters())  # as registered now
        assert gathered != last, f"after a {'last' if last else 'first'} backward pass: gathered={gathered}"
    assert all(hasattr(p, "full_tensor") and p.grad is not None for p in model.parameters())
    # The rollout's gathered weights carry into the update; the optimizer step shards them first,
    # and a checkpoint taken meanwhile holds the same weights (FSDP's state dict shards them).
    saved = where.full_state_dict()
    for then in ("optimizer step", "checkpoint"):
        with where.rollout_context(SharingEngine()):
            pass
        assert not any(hasattr(p, "full_tensor") for p in layers.parameters()), "carried into the update"
        if then == "checkpoint":
            check_close(where.full_state_dict(), saved, "a checkpoint after a rollout")
        else:
            where.shard_all()
        assert all(hasattr(p, "full_tensor") for p in model.parameters()), f"sharded for the {then}"


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
        optimizer_state.full_optimizer_state(optimizers[1])
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
    check_adapter_sync(context, ids)
    check_adapter_sync_gathers_units_only_with_the_base(context)
    check_no_grad_passes_leave_every_unit_sharded(context, ids)
    check_kept_gathered_across_micro_batches(context, ids)
    torch_dist.destroy_process_group()
    print("fsdp worker: all checks passed")


if __name__ == "__main__":
    main()
