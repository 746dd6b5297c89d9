"""Where the policy lives: FSDP2 sharding, full weights for rollouts and checkpoints, offloading.

Under `fsdp`, every decoder layer is one `fully_shard` unit and the rest of the model (embeddings,
final norm, output head, tied or not) is the root unit. The root is a `ShardedRoot` module around
the policy rather than the policy itself, because the update phase never calls the policy's
`forward`: `sequence_logprobs` runs the decoder body and then the output head a chunk at a time.
`sharded_forward(model, function)` runs any such computation as the root's forward, so FSDP
gathers the root's parameters before it, registers its backward hooks on the result, and
reduce-scatters every gradient in the backward pass (summed over ranks, not averaged: the loss is
normalised by global totals, as without FSDP).

Between forward passes the parameters are sharded `DTensor`s. The native and hf engines read the
policy's parameters in place, so `rollout_context` gathers every unit around a rollout (and merges
LoRA adapters); engines with their own copy get `rollout_weights`, full tensors gathered one at a
time and handed over on the CPU. Checkpoints gather a full state dict (`full_state_dict`) and the
optimizer state is saved and loaded as full tensors (`full_optimizer_state`), so rank 0 writes
the same files as a run without FSDP and a resumed run replays exactly.

A `Placement` attached to the policy (and to the reference model) records what `launch` decided;
the trainer and the update phase ask it through the functions here and never branch on config.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grpoflow.policy import lora, offload

logger = logging.getLogger("grpoflow")

PLACEMENT_ATTRIBUTE = "_grpoflow_placement"
DECODER_LAYER_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers", "layers")
"""Where causal LMs keep their list of decoder layers (Llama/Qwen/Mistral, OPT, GPT-2, GPT-NeoX)."""


class ShardedRoot(nn.Module):
    """The FSDP root around a policy: its forward runs `function(*args, **kwargs)`, so whatever
    the function does with the policy (decoder body, output head) happens inside the root's
    forward. Tensor arguments are moved to the root's device by FSDP."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)


@dataclass(kw_only=True, slots=True)
class Placement:
    """How a module is laid out over devices and ranks."""

    device: torch.device
    """Where its computations run."""
    root: ShardedRoot | None = None
    """The FSDP root when sharded."""
    offload_model: bool = False
    """Weights on the CPU while the module is not in use (replicated models only)."""
    gc_collect: bool = False
    """Collect garbage and empty the CUDA cache after each offload."""

    @property
    def units(self) -> list[nn.Module]:
        """The FSDP modules, root first."""
        from torch.distributed.fsdp import FSDPModule

        return (
            [module for module in self.root.modules() if isinstance(module, FSDPModule)] if self.root else []
        )


def placement(module: nn.Module | None) -> Placement | None:
    """The placement `launch` attached to `module`, or None."""
    return getattr(module, PLACEMENT_ATTRIBUTE, None)


def attach(module: nn.Module, where: Placement) -> None:
    # Not a registered attribute: the root holds the module, and a cycle of submodules would make
    # `modules()` recurse forever.
    object.__setattr__(module, PLACEMENT_ATTRIBUTE, where)


def is_sharded(module: nn.Module | None) -> bool:
    where = placement(module)
    return where is not None and where.root is not None


def compute_device(module: nn.Module) -> torch.device:
    """Where `module`'s inputs go: its placement's device, else its first parameter's."""
    where = placement(module)
    return where.device if where is not None else next(module.parameters()).device


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder layers of a causal LM (the base model of a PEFT model)."""
    base = lora.generation_model(model)
    for path in DECODER_LAYER_PATHS:
        found: Any = base
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, nn.ModuleList) and len(found) > 0:
            return found
    raise ValueError(
        f"fsdp needs the model's list of decoder layers, but {type(base).__name__} has none at "
        f"{', '.join(DECODER_LAYER_PATHS)}: train it with fsdp=false"
    )


def mixed_precision(choice: str, weights_dtype: torch.dtype, device: torch.device):
    """FSDP's MixedPrecisionPolicy for `fsdp_mixed_precision`: bf16 gathers float32 weights in
    bfloat16; gradients are reduced in float32 unless `no`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if choice == "no":
        return MixedPrecisionPolicy()
    wanted = choice == "bf16" or device.type == "cuda"
    param_dtype = torch.bfloat16 if wanted and weights_dtype == torch.float32 else None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def shard_model(
    model: nn.Module,
    device: torch.device,
    *,
    world_size: int,
    offload_params: bool = False,
    precision: str = "auto",
) -> Placement:
    """Shard `model` in place with FSDP2 over `world_size` ranks (every rank calls this with the
    same full weights) and attach its placement. One unit per decoder layer, the rest in the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    layers = decoder_layers(model)
    weights_dtype = next(model.parameters()).dtype
    options = {
        "mesh": init_device_mesh(device.type, (world_size,)),
        "mp_policy": mixed_precision(precision, weights_dtype, device),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if offload_params
        else OffloadPolicy(),
    }
    for layer in layers:
        fully_shard(layer, reshard_after_forward=True, **options)
    root = ShardedRoot(model)
    fully_shard(root, reshard_after_forward=False, **options)
    units = [module for module in root.modules() if hasattr(module, "set_gradient_divide_factor")]
    for unit in units:
        # Sum over ranks (the loss carries the normalisation), as a plain SUM reduction: gloo has
        # no pre-multiplied sum.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    # FSDP picks its root as the first unit to run forward; run the root once before any engine
    # calls a layer directly.
    with torch.no_grad():
        root(lambda: None)
    root.reshard()
    where = Placement(device=device, root=root)
    attach(model, where)
    return where


def sharded_forward(model: nn.Module, function: Callable[[], Any]) -> Any:
    """`function()`, which runs `model` (or a view of it), inside the FSDP root's forward when
    `model` is sharded; plainly otherwise."""
    where = placement(model)
    if where is None or where.root is None:
        return function()
    result = where.root(function)
    if not torch.is_grad_enabled():
        # The root keeps its gathered parameters after forward for the backward pass; without
        # one they would stay gathered, and registered in place of the shards the optimizer holds.
        where.root.reshard()
    return result


def clip_gradients(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` over every rank's shards: the global norm, as a plain tensor."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@contextmanager
def full_parameters(model: nn.Module) -> Iterator[None]:
    """Within the block a sharded model holds its full (gathered) parameters as plain tensors,
    also across forward calls; leaving, they are freed. A no-op for a replicated model."""
    units = placement(model).units if is_sharded(model) else []
    root = units[0] if units else None
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not root, recurse=False)


@contextmanager
def rollout_context(model: nn.Module, engine) -> Iterator[None]:
    """Around a rollout. An engine that reads the policy's parameters (`shares_policy_weights`)
    sees them full and with LoRA adapters merged. For an engine with its own copy, the policy's
    weights go to the CPU meanwhile under `offload_model`."""
    where = placement(model)
    if engine.shares_policy_weights:
        with full_parameters(model), lora.merged_adapters(model):
            yield
        return
    if where is not None and where.offload_model:
        with offload.module_offloaded(model, where.device, gc_collect=where.gc_collect):
            yield
        return
    yield


def in_use(module: nn.Module | None):
    """A context in which `module` (a reference model under `offload_model`) is on its device."""
    where = placement(module)
    if module is None or where is None or not where.offload_model:
        return nullcontext()
    return _on_device(module, where)


@contextmanager
def _on_device(module: nn.Module, where: Placement) -> Iterator[None]:
    offload.move_module(module, where.device)
    try:
        yield
    finally:
        offload.move_module(module, offload.CPU)
        if where.gc_collect:
            offload.release_memory()


def rollout_weights(model: nn.Module, engine) -> Iterable[tuple[str, torch.Tensor]]:
    """What `engine.update_weights` receives after an update (see `lora.rollout_weights`).

    Sharded: nothing for an engine that reads the policy in place (it sees the new weights at the
    next `rollout_context`); for any other engine the merged weights, each gathered in full only
    when the engine takes it and handed over as a CPU tensor, so neither this rank's GPU nor an
    engine that collects the whole list holds more than one gathered tensor at a time."""
    if not is_sharded(model):
        return lora.rollout_weights(model, engine)
    if engine.shares_policy_weights:
        return iter(())
    return _gathered_weights(model)


def _gathered_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`lora.merged_weights` of a sharded model, on the CPU: the root unit (embeddings, norm,
    head) gathered throughout, each decoder layer gathered only while its weights are given (in
    the mixed-precision dtype when one is set). Every rank must walk it in step."""
    base = lora.generation_model(model)
    layers = decoder_layers(model)
    prefix = next(name for name, module in base.named_modules() if module is layers)
    root, seen = placement(model).units[0], set()
    with torch.no_grad(), _unsharded(root):
        for name, tensor in lora.module_weights(base, "", seen, skip=(layers,)):
            yield name, tensor.detach().to("cpu", copy=True)
        for index, layer in enumerate(layers):
            with _unsharded(layer):
                for name, tensor in lora.module_weights(layer, f"{prefix}.{index}.", seen):
                    yield name, tensor.detach().to("cpu", copy=True)


@contextmanager
def _unsharded(unit: nn.Module) -> Iterator[None]:
    unit.unshard()
    try:
        yield
    finally:
        unit.reshard()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full state dict of a sharded model on the CPU (a collective: every rank calls it; rank 0
    writes it), or None for a replicated model, which saves its own."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Tied weights come gathered into separate tensors: keep the first name only, as
    # `save_pretrained` does for the tensors of a whole model that share storage.
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    aliases = {name for group in names.values() for name in group[1:]}
    return {name: tensor for name, tensor in state.items() if name not in aliases}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Make `optimizer.state_dict()` hold full CPU tensors in place of its DTensor shards (a
    collective: every rank calls it) and `load_state_dict` take them back, each rank keeping its
    shard. A checkpoint then holds the same optimizer state as without FSDP."""
    optimizer.register_state_dict_post_hook(_gather_optimizer_state)
    optimizer.register_load_state_dict_pre_hook(_scatter_optimizer_state)


def _gather_optimizer_state(_optimizer, state_dict: dict) -> dict:
    state = {}
    for index, values in state_dict["state"].items():
        state[index] = {
            key: value.full_tensor().cpu() if hasattr(value, "full_tensor") else value
            for key, value in values.items()
        }
    return {**state_dict, "state": state}


def _scatter_optimizer_state(optimizer, state_dict: dict) -> dict:
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    state = {}
    for index, values in state_dict["state"].items():
        parameter = parameters[index]
        state[index] = {key: _local_shard(value, parameter) for key, value in values.items()}
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


def place_models(
    model: nn.Module,
    ref_model: nn.Module | None,
    training,
    device: torch.device,
    *,
    world_size: int,
    engine_shares_weights: bool,
) -> None:
    """Apply the run's layout (`training`: a TrainingConfig) to the policy and its reference
    model, after every rank holds the same full weights: FSDP sharding, or the offload options."""
    if training.fsdp and world_size == 1:
        logger.warning("fsdp=true with a single process: nothing to shard, the model stays whole")
    if training.fsdp and world_size > 1:
        precision = training.fsdp_mixed_precision
        options = {
            "world_size": world_size,
            "offload_params": training.fsdp_offload_params,
            "precision": precision,
        }
        where = shard_model(model, device, **options)
        if ref_model is not None and lora.is_peft_model(model):
            attach(ref_model, where)  # the policy with its adapters off: the policy's own units
        elif ref_model is not None:
            shard_model(ref_model, device, **options)
        return
    if training.offload_model and engine_shares_weights:
        logger.warning(
            "offload_model: the rollout engine reads the policy's own weights, so only a reference "
            "model copy is offloaded (the policy moves to the CPU only while vLLM generates)"
        )
    where = Placement(
        device=device, offload_model=training.offload_model, gc_collect=training.gc_collect_after_offload
    )
    attach(model, where)
    if ref_model is not None and training.offload_model and not lora.is_peft_model(model):
        offload.move_module(ref_model, offload.CPU)
        attach(ref_model, where)
