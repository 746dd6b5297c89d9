"""The policy's training forward on Liger Kernel's fused Triton kernels (`use_liger_kernel`): each
decoder layer's RMSNorms, its SwiGLU/GeGLU MLP (a mixture-of-experts model's experts excepted:
grpoflow runs them its own way) and its rotary embedding, one kernel each where the eager forward
launches several, recomputed as cheaply under gradient checkpointing. Not Liger's cross-entropy or
fused-linear losses: grpoflow scores log-probs on its own fused path.

Liger's `apply_liger_kernel_to_<model type>(model=...)` binds the kernels' forwards on the
instance's norm and MLP modules; their parameters and names are unchanged, so checkpoints, LoRA,
FSDP, weight syncs and the native engine's family forward read them as before. It also replaces
classes and functions in transformers' modeling module, which would reach every model of that type
in the process (a reference model on another device, a model built later) and its rotary function
is only reached that way. `apply` keeps the kernels to the instance: it puts the modeling module
and its classes back as they were, then binds the instance's own modules to what they would have
looked up there (an attention layer's forward sees Liger's rotary function; the module does not).

`choose` resolves the option from the run's facts: auto is on where the kernels run and pay
(CUDA, liger-kernel installed, torch_compile off, which already fuses these operations, the
batch-invariant kernels off, which replace the same modules, and a model type Liger has kernels
for); true where one of those fails is refused with the fix.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import sys
import types
from dataclasses import dataclass
from typing import Literal

from torch import nn

from grpoflow.policy.function_globals import with_globals

logger = logging.getLogger("grpoflow")

Setting = bool | Literal["auto"]

KERNELS = frozenset({"rms_norm", "swiglu", "geglu", "rope"})
"""The flags of Liger's apply functions that grpoflow turns on; every other flag is off."""
MLP_KERNELS = frozenset({"swiglu", "geglu"})

INSTALL = "pip install grpoflow[liger]"


@dataclass(frozen=True, slots=True)
class LigerFacts:
    """What decides whether Liger's kernels run."""

    cuda: bool
    """The policy trains on a CUDA device (the kernels are Triton GPU kernels)."""
    installed: bool
    """liger-kernel is importable."""
    model_type: str | None
    """The policy's model type (None: not read, an earlier fact already decides)."""
    torch_compile: bool
    """The decoder layers are compiled (as chosen, not only as given)."""
    batch_invariant: Setting = "auto"
    """batch_invariant as given."""
    batch_invariant_runs: bool = False
    """The batch-invariant kernels would run (given, or auto with on_policy_sampling on CUDA);
    their auto yields to use_liger_kernel given true."""


def installed() -> bool:
    """liger-kernel is importable."""
    return importlib.util.find_spec("liger_kernel") is not None


def supported_model_types() -> frozenset[str]:
    """The model types Liger has kernels for (liger-kernel installed)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def obstacle(facts: LigerFacts, given: bool = False) -> tuple[str, str] | None:
    """The first reason the kernels cannot (or, unless `given`, should not) run, with its fix;
    None when they can. Given true, they take the place of batch_invariant's auto."""
    if facts.torch_compile:
        return "torch_compile is on (it fuses the same operations)", "set torch_compile: false"
    if facts.batch_invariant is True or (facts.batch_invariant_runs and not given):
        return (
            "the batch-invariant kernels run (they replace the same modules)",
            "set batch_invariant: false",
        )
    if not facts.cuda:
        return "no CUDA device (the kernels are Triton GPU kernels)", "train on a CUDA GPU"
    if not facts.installed:
        return "liger-kernel is not installed", INSTALL
    if facts.model_type not in supported_model_types():
        return f"Liger has no kernels for model type {facts.model_type!r}", "leave it to a supported model"
    return None


def choose(setting: Setting, facts: LigerFacts) -> tuple[bool, str]:
    """Whether the kernels run and why. true where they cannot run raises one line naming the fix."""
    if setting is False:
        return False, "set false"
    found = obstacle(facts, given=setting is True)
    if setting is True:
        if found is not None:
            reason, fix = found
            raise ValueError(
                f"use_liger_kernel: true cannot run: {reason}; {fix} or set use_liger_kernel: false"
            )
        return True, "set true"
    if found is not None:
        return False, f"auto: off, {found[0]}"
    return (
        True,
        f"auto: on (CUDA, liger-kernel installed, torch_compile off, model type {facts.model_type!r})",
    )


def apply(model: nn.Module, moe: bool = False) -> None:
    """Liger's RMSNorm, SwiGLU/GeGLU MLP (not a MoE model's experts) and rotary kernels on
    `model` (a transformers causal LM of a supported type) alone: what Liger's apply function
    changes in the modeling modules is put back and bound on the instance's modules instead."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    function = MODEL_TYPE_TO_APPLY_LIGER_FN[model.config.model_type]
    modules = modeling_modules(model)
    saved = {module: dict(vars(module)) for module in modules}
    classes = {cls: dict(vars(cls)) for cls in module_classes(modules)}
    try:
        function(model=model, **kernel_flags(function, moe))
    finally:
        functions = restore_modules(saved)
        methods = restore_classes(classes)
    bind_to_instance(model, functions, methods)
    logger.info(
        "use_liger_kernel: %s runs on Liger's RMSNorm, MLP and rotary kernels", model.config.model_type
    )


def kernel_flags(function, moe: bool) -> dict[str, bool]:
    """The boolean flags of Liger's apply `function`: KERNELS on (a MoE model's MLP kernels off),
    every other (losses, other layers) off."""
    wanted = KERNELS - MLP_KERNELS if moe else KERNELS
    return {
        name: name in wanted
        for name, parameter in inspect.signature(function).parameters.items()
        if isinstance(parameter.default, bool)
    }


def modeling_modules(model: nn.Module) -> list[types.ModuleType]:
    """The transformers modeling modules that define `model`'s classes."""
    names = {type(module).__module__ for module in model.modules()}
    return [sys.modules[name] for name in sorted(names) if name.startswith("transformers.models.")]


def module_classes(modules: list[types.ModuleType]) -> list[type]:
    """The classes each of `modules` defines."""
    return [
        value
        for module in modules
        for value in vars(module).values()
        if isinstance(value, type) and value.__module__ == module.__name__
    ]


def put_back(holder: object, before: dict) -> dict[str, object]:
    """Set `holder`'s attributes (a module's globals, a class's) back to `before`; the values of
    those that had changed."""
    now = dict(vars(holder))
    changed = {name: now[name] for name in now if name not in before or now[name] is not before[name]}
    for name in changed:
        if name in before:
            setattr(holder, name, before[name])
        else:
            delattr(holder, name)
    return changed


def restore_modules(saved: dict[types.ModuleType, dict]) -> dict[types.ModuleType, dict[str, object]]:
    """Each module's globals as `saved`; the functions that had been put in their place, by module."""
    replaced: dict[types.ModuleType, dict[str, object]] = {}
    for module, before in saved.items():
        changed = put_back(module, before)
        functions = {name: value for name, value in changed.items() if isinstance(value, types.FunctionType)}
        if functions:
            replaced[module] = functions
    return replaced


def restore_classes(saved: dict[type, dict]) -> dict[type, dict[str, object]]:
    """Each class's attributes as `saved`; those that had been changed, by class."""
    replaced = {cls: put_back(cls, before) for cls, before in saved.items()}
    return {cls: changed for cls, changed in replaced.items() if changed}


def bind_to_instance(
    model: nn.Module,
    functions: dict[types.ModuleType, dict[str, object]],
    methods: dict[type, dict[str, object]],
) -> None:
    """Give `model`'s modules what the modeling modules held for them: a class's changed methods
    bound on its instances, and a forward that looks up a replaced function seeing the replacement."""
    for module in model.modules():
        for name, value in methods.get(type(module), {}).items():
            bound = value.__get__(module, type(module)) if isinstance(value, types.FunctionType) else value
            module.__dict__[name] = bound
        forward = getattr(type(module), "forward", None)
        if "forward" in module.__dict__ or not isinstance(forward, types.FunctionType):
            continue
        home = sys.modules.get(forward.__module__)
        wanted = {
            name: value
            for name, value in functions.get(home, {}).items()
            if name in forward.__code__.co_names
        }
        if wanted:
            module.forward = types.MethodType(with_globals(forward, wanted), module)
