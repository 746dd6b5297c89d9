"""LoRA adapters through PEFT: adding them, what rollout engines and the reference model see of
them (adapter-only checkpoints: `grpoflow.policy.adapter_checkpoints`).

A LoRA policy is a `peft.PeftModel` around the base model. Only the adapters (and
`modules_to_save`) train; the base weights stay exactly as loaded, which gives two things for
free: the reference model is the policy with its adapters switched off (no copy), and a checkpoint
needs only the adapter. How rollout engines see them: the native engine adds the adapters'
low-rank products inside its own projections (no merge); the hf engine generates inside
`merged_adapters`; engines that keep their own weights get the base once and then the adapters
alone when they accept them (`grpoflow serve`, colocated vLLM), else the merged weights
(`merged_weights`).

PEFT is imported only when a run uses LoRA.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from grpoflow.engines.base import RolloutEngine
from grpoflow.engines.vllm_adapters import expert_adapter_obstacle
from grpoflow.options import require
from grpoflow.phases import phase
from grpoflow.policy.lora_dropout import fuse_lora_dropout
from grpoflow.policy.lora_moe import (
    adapted_parameters,
    check_target_parameters,
    moe_lora_targets,
    refuse_moved_targets,
)
from grpoflow.policy.lora_precision import compute_in_input_dtype
from grpoflow.transport.adapters import DOWN, UP


@dataclass(kw_only=True, slots=True)
class AdapterConfig:
    """Full fine-tuning or LoRA adapters (through PEFT)."""

    train_type: Literal["full", "lora"] = "full"
    """Train every parameter, or LoRA adapters only."""
    lora_rank: int = 8
    """LoRA rank r."""
    lora_alpha: int = 32
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_rank)."""
    lora_dropout: float = 0.05
    """Dropout on the LoRA input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names that get adapters; all-linear targets every linear layer but the output head
    (of a mixture-of-experts model: outside the experts)."""
    target_parameters: list[str] = field(default_factory=list)
    """Parameters that get adapters beside `target_modules` (PEFT's and ms-swift's name): a
    mixture-of-experts model's fused experts, `experts.gate_up_proj` and `experts.down_proj`
    (Qwen3-MoE and others of transformers), each expert with its own adapter of rank lora_rank.
    Needs lora_dropout 0. The native engine adds them in its forward; other engines get the
    merged weights at every sync."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters (e.g. embed_tokens)."""

    def __post_init__(self) -> None:
        require(self.lora_rank > 0, "lora_rank", "> 0", self.lora_rank)
        require(self.lora_alpha > 0, "lora_alpha", "> 0", self.lora_alpha)
        require(0 <= self.lora_dropout < 1, "lora_dropout", "in [0, 1)", self.lora_dropout)
        require(bool(self.target_modules), "target_modules", "at least one module name (or all-linear)", [])
        if self.target_parameters and self.lora_dropout != 0:
            raise ValueError(
                f"target_parameters {list(self.target_parameters)} needs lora_dropout 0 (PEFT cannot apply "
                f"dropout to the input of an adapted parameter), got {self.lora_dropout}: set lora_dropout: 0"
            )

    def apply(self, model: nn.Module) -> nn.Module:
        """`model` with LoRA adapters (train_type lora), or as it is (full)."""
        return add_lora(model, self) if self.train_type == "lora" else model


ALL_LINEAR = "all-linear"


def is_peft_model(model: object) -> bool:
    """Whether `model` is a PEFT model (False without importing PEFT when no one has)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def add_lora(model: nn.Module, config: AdapterConfig) -> nn.Module:
    """`model` wrapped in a PeftModel with LoRA adapters on `config.target_modules`; every base
    weight is frozen, the adapters and `modules_to_save` train."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ValueError("train_type=lora needs PEFT: pip install peft") from None
    targets = list(config.target_modules)
    if ALL_LINEAR in (name.lower() for name in targets):
        if len(targets) > 1:
            raise ValueError(
                f"target_modules {targets}: {ALL_LINEAR} already targets every linear layer; "
                "give it alone or list module names"
            )
        targets = ALL_LINEAR
    targets = moe_lora_targets(model, targets)
    check_target_parameters(model, list(config.target_parameters))
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        target_parameters=list(config.target_parameters) or None,
        modules_to_save=list(config.modules_to_save) or None,
        task_type="CAUSAL_LM",
    )
    tied = _tied_names(model)
    try:
        peft_model = get_peft_model(model, lora)
    except ValueError as error:
        raise ValueError(
            f"LoRA adapters could not be added ({error}): target_modules and modules_to_save take "
            "module names of the model (q_proj, model.norm, ...) or all-linear"
        ) from None
    _refuse_tied(peft_model, tied)
    refuse_moved_targets(peft_model, targets, list(config.target_parameters))
    compute_in_input_dtype(peft_model)
    fuse_lora_dropout(peft_model)
    return peft_model


def generation_model(model: nn.Module) -> nn.Module:
    """The module a rollout engine runs: the policy, or for a PeftModel the transformers model
    inside it (its LoRA layers merged during rollouts by `merged_adapters`), so an engine meets
    the base architecture's class and attribute layout."""
    return model.get_base_model() if is_peft_model(model) else model


@contextmanager
def merged_adapters(model: nn.Module) -> Iterator[None]:
    """Within the block, the LoRA adapters are merged into the base weights; a no-op for a plain
    model.

    Every adapted layer computes `(W + alpha / r * B A) x` from W's own storage (addresses are kept,
    so engines holding views or captured CUDA graphs see the merged values) and skips the LoRA
    branch (the `merge` phase; leaving, `unmerge`). Leaving, PEFT's unmerge subtracts the update again, which rounds (by up to an ulp in
    bfloat16); repeated every step the frozen base would drift, so the base weights are kept on
    the CPU and copied back bit for bit. Costs one CPU copy of the adapted weights per call.
    """
    if not is_peft_model(model):
        yield
        return
    with phase("merge"):
        saved = [(tensor, tensor.detach().to("cpu", copy=True)) for tensor in _adapted_base_weights(model)]
    try:
        with phase("merge"), torch.no_grad():
            model.merge_adapter()
        yield
    finally:
        with phase("unmerge"), torch.no_grad():
            model.unmerge_adapter()
            for tensor, original in saved:
                tensor.copy_(original)


def merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` pairs of the policy with its adapters merged, for engines that copy weights.

    Names equal the base model's Hugging Face names, in the order and with the tied weights once,
    as `named_parameters()` of the plain base model gives them: PEFT's `base_model.model.` prefix,
    `.base_layer` and the adapter weights are gone, and a module in `modules_to_save` appears
    under its own name with its trained values. An engine loads them as it loads the base model.
    Adapted weights are new tensors, `W + alpha / r * B A` rounded to W's dtype exactly as
    `merged_adapters` computes them (inside that block: the merged parameters themselves); the
    others are the policy's own parameters. Nothing in the policy changes. A plain model yields
    its `named_parameters()`.
    """
    if not is_peft_model(model):
        yield from model.named_parameters()
        return
    yield from _plain_parameters(model.get_base_model(), "", set())


def merged_rollout_weights(model: nn.Module, engine: RolloutEngine) -> Iterable[tuple[str, torch.Tensor]]:
    """What `engine.update_weights` receives after an update from a whole (unsharded) policy;
    `Placement.rollout_weights` gives the same for any layout.

    An engine that generates from the policy's module (`shares_policy_weights`) gets that module's
    own parameters: nothing to copy (the native engine adds the adapters in its forward; others
    run inside `merged_adapters`). Any other engine gets what `rollout_parts` says: for one that
    adds adapters to its own copy of the base (`accepts_adapters`), `adapter_update`: the base on
    its first sync (until it `holds_base`), then the adapters (and `modules_to_save`) alone; else
    `merged_weights`.
    """
    if engine.shares_policy_weights:
        return generation_model(model).named_parameters()
    return rollout_parts(model, engine).weights(generation_model(model))


@dataclass(frozen=True, slots=True)
class RolloutParts:
    """What an engine with its own copy of the weights gets of each part of the policy's
    generation model, so that a sharded policy can give it one gathered part at a time."""

    adapters: bool = False
    """The engine adds the adapters to its own base (`adapter_weights`); else merged weights
    (`module_weights`)."""
    with_base: bool = True
    """With the adapters: the base weights too (the engine's first sync)."""

    def weights(
        self,
        module: nn.Module,
        prefix: str = "",
        seen: set[int] | None = None,
        skip: tuple[nn.Module, ...] = (),
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`module`'s share, named and deduplicated as `module_weights` names them."""
        if self.adapters:
            return adapter_weights(module, prefix, seen, skip, with_base=self.with_base)
        return module_weights(module, prefix, seen, skip)

    def needs(self, module: nn.Module, skip: tuple[nn.Module, ...] = ()) -> bool:
        """Whether `module` (less the subtrees `skip`) may have a share: every part does, but
        only the adapted ones when the adapters go alone."""
        return self.with_base or has_adapters(module, skip)


def rollout_parts(model: nn.Module, engine: RolloutEngine) -> RolloutParts:
    """What `engine`, with its own copy of the weights, gets of `model`: the adapters (with the
    base until it `holds_base`) when it `accepts_adapters` of a PEFT model, else merged weights
    (always for adapters on fused expert parameters: `lora_moe`)."""
    if (
        is_peft_model(model)
        and engine.capabilities.accepts_adapters
        and expert_adapter_obstacle(model) is None
    ):
        return RolloutParts(adapters=True, with_base=not engine.holds_base)
    return RolloutParts()


def adapter_update(model: nn.Module, *, with_base: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """What an engine that adds adapters to its own copy of the base (`accepts_adapters`) gets:
    the adapters named as `grpoflow.transport.adapters` names them (A, and B times alpha / r) and
    the trained `modules_to_save`, plus, `with_base` (its first sync), every other base weight as
    loaded, unmerged. Names are the plain model's, as in `merged_weights`."""
    return adapter_weights(model.get_base_model(), with_base=with_base)


def adapter_weights(
    module: nn.Module,
    prefix: str = "",
    seen: set[int] | None = None,
    skip: tuple[nn.Module, ...] = (),
    *,
    with_base: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`adapter_update` of a part of the policy, as `module_weights` gives `merged_weights` of one:
    named under `prefix`, leaving out the subtrees `skip` and the parameters whose ids are in
    `seen` (which it extends)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    seen = set() if seen is None else seen
    if any(module is other for other in skip):
        return
    if isinstance(module, LoraLayer):
        if with_base:
            yield from _plain_parameters(module.get_base_layer(), prefix, seen)
        yield from _low_rank(module, prefix.removesuffix("."))
        return
    if isinstance(module, ModulesToSaveWrapper):
        for name, parameter in _plain_parameters(module, prefix, seen):
            yield name, whole(parameter)
        return
    if with_base:
        yield from _own_parameters(module, prefix, seen)
    for name, child in module.named_children():
        yield from adapter_weights(child, f"{prefix}{name}.", seen, skip, with_base=with_base)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP's DTensor) parameter gathered in full, a collective every rank calls in
    step; any other tensor as it is."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def _low_rank(layer, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The layer's active adapters as one A (sum of ranks, in) and one scaled B (out, sum of ranks)."""
    active = [adapter for adapter in layer.active_adapters if adapter in layer.lora_A]
    if not active or layer.disable_adapters:
        return
    with torch.no_grad():
        down = torch.cat([whole(layer.lora_A[adapter].weight).detach() for adapter in active])
        up = torch.cat(
            [whole(layer.lora_B[adapter].weight).detach() * layer.scaling[adapter] for adapter in active], 1
        )
    yield f"{name}{DOWN}", down
    yield f"{name}{UP}", up


class WithoutAdapters(nn.Module):
    """`module` of the PeftModel `policy` (default: the whole policy) run with the adapters off:
    the frozen base model's outputs from the policy's own weights, without a copy.

    A LoRA run's reference model. Each call enters PEFT's `disable_adapter()` with the policy in
    eval mode (no dropout) and restores both after. `get_decoder` and `get_output_embeddings`
    return views as well, so the chunked log-probs of `sequence_logprobs` (the decoder body, then
    the output head a chunk at a time) see the base model too. The view holds the policy without
    registering it as a submodule: `train()`, `eval()` or `parameters()` of the view leave the
    policy alone.
    """

    def __init__(self, policy: nn.Module, module: nn.Module | None = None) -> None:
        super().__init__()
        if not is_peft_model(policy):
            raise TypeError(f"WithoutAdapters needs a PEFT model, got {type(policy).__name__}")
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "module", policy if module is None else module)

    @property
    def config(self):
        return getattr(self.module, "config", None)

    @property
    def weight(self) -> torch.Tensor:
        with self.policy.disable_adapter():
            return self.module.weight

    def forward(self, *args, **kwargs):
        with self._adapters_off():
            return self.module(*args, **kwargs)

    def get_decoder(self) -> nn.Module:
        return WithoutAdapters(self.policy, self.module.get_decoder())

    def get_output_embeddings(self) -> nn.Module | None:
        head = self.module.get_output_embeddings()
        return WithoutAdapters(self.policy, head) if head is not None and has_adapters(head) else head

    @contextmanager
    def _adapters_off(self) -> Iterator[None]:
        was_training = self.policy.training
        self.policy.eval()
        try:
            with self.policy.disable_adapter():
                yield
        finally:
            self.policy.train(was_training)


def _tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Parameter name -> every name of the same tensor, for tensors under several names."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return {name: group for group in names.values() if len(group) > 1 for name in group}


def _refuse_tied(model: nn.Module, tied: dict[str, list[str]]) -> None:
    """An adapter or a trained copy on a tied weight (lm_head and embed_tokens) breaks the tie:
    merged for rollouts, a LoRA update of one would change the other too, and a trained copy of
    one would not reach the other; rollouts and exports would no longer be the trained policy."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    for name, module in model.get_base_model().named_modules():
        weight = f"{name}.weight"
        if isinstance(module, LoraLayer | ModulesToSaveWrapper) and weight in tied:
            others = ", ".join(other for other in tied[weight] if other != weight)
            raise ValueError(
                f"{name} shares its weight with {others} (tied embeddings): leave it out of "
                "target_modules and modules_to_save (all-linear leaves the output head out)"
            )


def _adapted_base_weights(model: nn.Module) -> list[torch.Tensor]:
    """The base parameters a merge writes to: those of every LoRA layer's base layer (once each:
    nested `ParamWrapper`s share theirs)."""
    from peft.tuners.lora import LoraLayer

    found = {
        id(parameter): parameter
        for module in model.modules()
        if isinstance(module, LoraLayer)
        for parameter in module.get_base_layer().parameters()
    }
    return list(found.values())


def has_adapters(module: nn.Module, skip: tuple[nn.Module, ...] = ()) -> bool:
    """Whether `module`, less the subtrees `skip`, holds PEFT layers (adapters or `modules_to_save`)."""
    if "peft" not in sys.modules or any(module is other for other in skip):
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    if isinstance(module, BaseTunerLayer | AuxiliaryTrainingWrapper):
        return True
    return any(has_adapters(child, skip) for child in module.children())


def module_weights(
    module: nn.Module, prefix: str = "", seen: set[int] | None = None, skip: tuple[nn.Module, ...] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """`merged_weights` of a part of the policy: `module`'s parameters named `prefix + name` as the
    model without PEFT names them, adapters merged, leaving out the subtrees `skip` and the
    parameters whose ids are in `seen` (which it extends: tied weights come once over calls)."""
    seen = set() if seen is None else seen
    if "peft" not in sys.modules:
        for name, parameter in _walk(module, prefix, skip):
            if id(parameter) not in seen:
                seen.add(id(parameter))
                yield name, parameter
        return
    yield from _plain_parameters(module, prefix, seen, skip)


def _walk(module: nn.Module, prefix: str, skip: tuple[nn.Module, ...]) -> Iterator[tuple[str, nn.Parameter]]:
    if any(module is other for other in skip):
        return
    for name, parameter in module.named_parameters(recurse=False):
        yield prefix + name, parameter
    for name, child in module.named_children():
        yield from _walk(child, f"{prefix}{name}.", skip)


def _plain_parameters(
    module: nn.Module, prefix: str, seen: set[int], skip: tuple[nn.Module, ...] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """`module`'s parameters as the model without PEFT names them, adapters merged (pre-order, as
    `named_parameters` walks); `seen` holds the ids of parameters already given (tied weights)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    if any(module is other for other in skip):
        return
    if isinstance(module, LoraLayer):
        adapted = adapted_parameters(module)
        for name, parameter in module.get_base_layer().named_parameters(recurse=False):
            if id(parameter) not in seen:
                seen.add(id(parameter))
                layer = adapted.get(name)
                yield prefix + name, parameter if layer is None else _merged_weight(layer, parameter)
        return
    if isinstance(module, ModulesToSaveWrapper):
        active = [name for name in module.active_adapters if name in module.modules_to_save]
        trained = module.modules_to_save[active[0]] if active and not module.disable_adapters else None
        yield from _plain_parameters(
            module.original_module if trained is None else trained, prefix, seen, skip
        )
        return
    yield from _own_parameters(module, prefix, seen)
    for name, child in module.named_children():
        yield from _plain_parameters(child, f"{prefix}{name}.", seen, skip)


def _own_parameters(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """`module`'s own parameters (not its children's) not yet in `seen`, named under `prefix`."""
    for name, parameter in module.named_parameters(recurse=False):
        if id(parameter) not in seen:
            seen.add(id(parameter))
            yield prefix + name, parameter


def _merged_weight(layer, weight: torch.Tensor) -> torch.Tensor:
    """`weight` plus the layer's unmerged active adapters, in `weight`'s dtype (as PEFT's
    in-place merge rounds it)."""
    adapters = set(layer.lora_A) | set(layer.lora_embedding_A)
    merged = weight.detach()
    with torch.no_grad():
        for adapter in layer.active_adapters:
            if adapter in adapters and adapter not in layer.merged_adapters:
                merged = (merged + layer.get_delta_weight(adapter)).to(weight.dtype)
    return merged
