"""Where the policy lives: FSDP2 sharding, full weights for rollouts and checkpoints, offloading.

Under `fsdp`, every decoder layer is one `fully_shard` unit and the rest of the model (embeddings,
final norm, output head, tied or not) is the root unit. The root is a `ShardedRoot` module around
the policy rather than the policy itself, because the update phase never calls the policy's
`forward`: `sequence_logprobs` runs the decoder body and then the output head a chunk at a time.
`Placement.sharded_forward(function)` runs any such computation as the root's forward, so FSDP
gathers the root's parameters before it, registers its backward hooks on the result, and
reduce-scatters every gradient in the backward pass (summed over ranks, not averaged: the loss is
normalised by global totals, as without FSDP).

Between forward passes the parameters are sharded `DTensor`s. The native and hf engines read the
policy's parameters in place, so `Placement.rollout_context` gathers every unit around a rollout
(and merges LoRA adapters for an engine that does not apply them itself); engines with their own
copy get `Placement.rollout_weights`, gathered one unit at a time and handed over on the CPU
(`grpoflow.policy.sharded_weights`; a LoRA policy's adapters alone, after the first sync, to an
engine that takes them). Checkpoints gather a full state dict (`Placement.full_state_dict`) and
the optimizer state is saved and loaded as full tensors (`optimizer_state`), so rank 0
writes the same files as a run without FSDP and a resumed run replays exactly.

Under `expert_model_parallel_size` (with fsdp) each rank keeps its share of every MoE layer's
experts (`grpoflow.policy.expert_parallel`), left out of FSDP's units: FSDP neither gathers nor
reduces them, their gradients being complete on their rank. A rollout gathers them in full beside
the units (`expert_shards.gathered_experts`), checkpoints hold them in full under their usual
names, and the gradient norm sums their squares over the ranks (`clip_gradients`).

`place_models` applies a `PlacementConfig` and returns a `Placement` for the policy and one for
its reference model; the run keeps them and hands them to whatever computes with the models. The
modules themselves carry nothing: a model built without `place_models` gets `Placement.local`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from grpoflow.engines.base import RolloutEngine
from grpoflow.phases import phase
from grpoflow.policy import expert_shards, lora, offload, sharded_weights
from grpoflow.policy.expert_parallel import expert_parameters, shard_experts
from grpoflow.policy.placement_config import PlacementConfig

logger = logging.getLogger("grpoflow")

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


@dataclass(kw_only=True, slots=True, eq=False)
class Placement:
    """A model and how it is laid out over devices and ranks; every computation that depends on
    the layout (forward passes, rollouts, weight syncs, checkpoints) goes through it."""

    module: nn.Module = field(repr=False)
    """The placed model (for a LoRA reference model under fsdp: the policy without adapters)."""
    device: torch.device
    """Where its computations run."""
    root: ShardedRoot | None = field(default=None, repr=False)
    """The FSDP root when sharded (a LoRA reference model shares the policy's)."""
    mesh: Any = field(default=None, repr=False)
    """Sharded: the device mesh the units are sharded over."""
    offload_model: bool = False
    """Weights on the CPU while the module is not in use (replicated models only)."""
    gc_collect: bool = False
    """Collect garbage and empty the CUDA cache after each offload."""
    reduce_every_micro_batch: bool = True
    """Sharded: whether every backward pass reduce-scatters the gradients (else the last one of
    each optimizer step, as `sync_gradients` says)."""
    reshard_after_forward: bool = True
    """Sharded: whether a decoder layer frees its gathered weights after its forward pass."""
    expert_group: Any = field(default=None, repr=False)
    """Under expert parallelism: the process group the experts are split over, else None."""
    experts_dtype: torch.dtype | None = None
    """Under expert parallelism: the dtype a rollout gathers the experts in (FSDP's mixed
    precision's; None: their own)."""
    gathered: bool = field(default=False, init=False, repr=False)
    """Inside `full_parameters`: every unit holds its full parameters until the block ends."""

    @classmethod
    def local(cls, module: nn.Module, device: torch.device | None = None) -> Placement:
        """`module` whole on one device: `device`, else its first parameter's."""
        return cls(module=module, device=device if device is not None else next(module.parameters()).device)

    @property
    def is_sharded(self) -> bool:
        return self.root is not None

    @property
    def forward_is_collective(self) -> bool:
        """Whether a forward pass all-gathers parameters over the ranks (sharded, outside
        `full_parameters`), so that every rank must run as many forward passes."""
        return self.root is not None and not self.gathered

    def max_over_ranks(self, value: int) -> int:
        """The largest `value` over the ranks the module is sharded over (a collective: every rank
        calls it); `value` itself when replicated."""
        if self.mesh is None:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=self.mesh.device_type)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=self.mesh.get_group())
        return int(tensor.item())

    @property
    def units(self) -> list[nn.Module]:
        """The FSDP modules, root first."""
        from torch.distributed.fsdp import FSDPModule

        return (
            [module for module in self.root.modules() if isinstance(module, FSDPModule)] if self.root else []
        )

    def sync_gradients(self, last: bool) -> None:
        """Before a backward pass, `last` of its optimizer step: whether it reduce-scatters the
        gradients accumulated so far (always, unless sharded and not reduce_every_micro_batch).
        Without reshard_after_forward the layers also keep their gathered weights from one
        micro-batch to the next (one all-gather per optimizer step, not per micro-batch); the
        step's last backward pass frees them, before the optimizer writes the shards."""
        if self.root is None:
            return
        if not self.reduce_every_micro_batch:
            self.root.set_requires_gradient_sync(last)
        if not self.reshard_after_forward:
            self.root.set_reshard_after_backward(last)

    def sharded_forward(self, function: Callable[[], Any]) -> Any:
        """`function()`, which runs the module (or a view of it), inside the FSDP root's forward
        when sharded; plainly otherwise."""
        if self.root is None:
            return function()
        result = self.root(function)
        if not torch.is_grad_enabled() and not self.gathered:
            # The root (and, without reshard_after_forward, every layer) keeps its gathered
            # parameters after forward for the backward pass; without one they would stay
            # gathered, registered in place of the shards the optimizer updates.
            for unit in self.units:
                unit.reshard()
        return result

    @contextmanager
    def full_parameters(self, keep: bool = False) -> Iterator[None]:
        """Within the block a sharded model holds its full (gathered) parameters as plain tensors,
        also across forward calls; leaving, they are freed (both in the `gather` phase), unless
        `keep`: then the next forward pass uses them as gathered, and they go at the update's
        last backward pass, a pass without gradients, or `shard_all`. A no-op for a
        replicated model."""
        units = self.units
        root = units[0] if units else None
        with phase("gather"):
            for unit in units:
                unit.set_reshard_after_forward(False, recurse=False)
                unit.unshard()
        self.gathered = bool(units)
        try:
            yield
        finally:
            self.gathered = False
            with phase("gather"):
                for unit in units:
                    if not keep:
                        unit.reshard()
                    unit.set_reshard_after_forward(
                        unit is not root and self.reshard_after_forward, recurse=False
                    )

    def shard_all(self) -> None:
        """Every unit sharded (those a rollout left gathered): before an optimizer step, which
        writes the shards the next gather reads. A no-op for units already sharded, and for a
        replicated model."""
        for unit in self.units:
            unit.reshard()

    @contextmanager
    def rollout_context(self, engine: RolloutEngine) -> Iterator[None]:
        """Around a rollout. An engine that reads the policy's parameters (`shares_policy_weights`)
        sees them full and, unless it applies LoRA adapters itself (`applies_adapters`), with the
        adapters merged. For an engine with its own copy, the policy's weights go to the CPU
        meanwhile under `offload_model`."""
        if engine.shares_policy_weights:
            merging = not engine.capabilities.applies_adapters
            merge = lora.merged_adapters(self.module) if merging else nullcontext()
            merged = merging and lora.is_peft_model(self.module)
            gathered = self.expert_group is not None
            experts = (
                expert_shards.gathered_experts(self.module, self.experts_dtype) if gathered else nullcontext()
            )
            # Without reshard_after_forward the update holds the full weights anyway: it starts from
            # the rollout's, unless merged with adapters (the unmerge rounds) or beside experts.
            keep = not (self.reshard_after_forward or merged or gathered)
            with self.full_parameters(keep), merge, experts:
                yield
            return
        if self.offload_model:
            with offload.module_offloaded(self.module, self.device, gc_collect=self.gc_collect):
                yield
            return
        yield

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Within the block the module is in eval mode (no dropout); its mode is restored after."""
        was_training = self.module.training
        self.module.eval()
        try:
            yield
        finally:
            self.module.train(was_training)

    def in_use(self) -> AbstractContextManager[None]:
        """A context in which the module (a reference model under `offload_model`) is on its device."""
        return self._on_device() if self.offload_model else nullcontext()

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        with phase("reload"):
            offload.move_module(self.module, self.device)
        try:
            yield
        finally:
            with phase("offload"):
                offload.move_module(self.module, offload.CPU)
            if self.gc_collect:
                offload.release_memory()

    def rollout_weights(self, engine: RolloutEngine) -> Iterable[tuple[str, torch.Tensor]]:
        """What `engine.update_weights` receives after an update (see `lora.merged_rollout_weights`).

        Sharded: nothing for an engine that reads the policy in place (it sees the new weights at
        the next `rollout_context`); for any other engine the same weights as unsharded (merged,
        or for one that `accepts_adapters` the base on its first sync and then the adapters
        alone), gathered one FSDP unit at a time and handed over as CPU tensors
        (`sharded_weights.gathered_weights`; a collective every rank walks in step)."""
        if not self.is_sharded:
            return lora.merged_rollout_weights(self.module, engine)
        if engine.shares_policy_weights:
            return iter(())
        parts = lora.rollout_parts(self.module, engine)  # read now: the engine holds_base once it takes them
        return sharded_weights.gathered_weights(
            self.module, self.units[0], decoder_layers(self.module), parts
        )

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full state dict of a sharded model on the CPU (a collective: every rank calls it;
        rank 0 writes it), or None for a replicated model, which saves its own."""
        if not self.is_sharded:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        model = self.module
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # Tied weights come gathered into separate tensors: keep the first name only, as
        # `save_pretrained` does for the tensors of a whole model that share storage.
        names: dict[int, list[str]] = {}
        for name, parameter in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(parameter), []).append(name)
        aliases = {name for group in names.values() for name in group[1:]}
        state = {name: tensor for name, tensor in state.items() if name not in aliases}
        if self.expert_group is not None:  # each rank's share in place of the full experts
            state.update(expert_shards.full_expert_weights(model))
        return state


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
    reduce_every_micro_batch: bool = True,
    reshard_after_forward: bool = True,
    expert_parallel: bool = False,
) -> Placement:
    """Shard `model` in place with FSDP2 over `world_size` ranks (every rank calls this with the
    same full weights); its placement. One unit per decoder layer, the rest in the root;
    `expert_parallel`: the experts split over the ranks first and left out of the units."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    layers = decoder_layers(model)
    weights_dtype = next(model.parameters()).dtype
    mesh = init_device_mesh(device.type, (world_size,))
    expert_group = mesh.get_group() if expert_parallel else None
    if expert_group is not None:
        shard_experts(model, expert_group)
    policy = mixed_precision(precision, weights_dtype, device)
    options = {
        "mesh": mesh,
        "mp_policy": policy,
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if offload_params
        else OffloadPolicy(),
        "ignored_params": set(expert_parameters(model)) or None,
    }
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **options)
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
    return Placement(
        module=model,
        device=device,
        root=root,
        mesh=mesh,
        reduce_every_micro_batch=reduce_every_micro_batch,
        reshard_after_forward=reshard_after_forward,
        expert_group=expert_group,
        experts_dtype=policy.param_dtype,
    )


def clip_gradients(parameters: list[nn.Parameter], max_norm: float, expert_group: Any = None) -> torch.Tensor:
    """`clip_grad_norm_` over every rank's shards: the global norm, as a plain tensor;
    `expert_group`: the placement's, whose experts' squares are summed over it."""
    if expert_group is not None:
        return expert_shards.clip_gradients(parameters, max_norm, expert_group)
    return lora.whole(torch.nn.utils.clip_grad_norm_(parameters, max_norm))


def place_models(
    model: nn.Module,
    ref_model: nn.Module | None,
    config: PlacementConfig,
    device: torch.device,
    *,
    world_size: int,
    engine_shares_weights: bool,
) -> tuple[Placement, Placement | None]:
    """Lay out the policy and its reference model as `config` says, after every rank holds the same
    full weights (FSDP sharding, or the offload options); the placement of each (None for no
    reference model)."""
    if config.fsdp and world_size == 1:
        logger.warning("fsdp=true with a single process: nothing to shard, the model stays whole")
    if config.fsdp and world_size > 1:
        options = {
            "world_size": world_size,
            "offload_params": config.fsdp_offload_params,
            "precision": config.fsdp_mixed_precision,
        }
        policy = shard_model(
            model,
            device,
            **options,
            reduce_every_micro_batch=config.reduces_every_micro_batch,
            reshard_after_forward=config.reshards_after_forward,
            expert_parallel=config.expert_model_parallel_size > 1,
        )
        if ref_model is None:
            return policy, None
        if lora.is_peft_model(model):  # the policy with its adapters off: the policy's own units
            return policy, dataclasses.replace(policy, module=ref_model)
        return policy, shard_model(ref_model, device, **options)
    if config.offload_model and engine_shares_weights:
        logger.warning(
            "offload_model: the rollout engine reads the policy's own weights, so only a reference "
            "model copy is offloaded (the policy moves to the CPU only while vLLM generates)"
        )
    gc_collect = config.gc_collect_after_offload
    policy = Placement(module=model, device=device, offload_model=config.offload_model, gc_collect=gc_collect)
    if ref_model is None:
        return policy, None
    offloads_ref = config.offload_model and not lora.is_peft_model(model)
    if offloads_ref:
        offload.move_module(ref_model, offload.CPU)
    return policy, Placement(
        module=ref_model, device=device, offload_model=offloads_ref, gc_collect=gc_collect
    )
