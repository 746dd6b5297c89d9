"""LoRA targets of a mixture-of-experts policy.

transformers stores a MoE layer's experts as fused parameters (`experts.gate_up_proj` (E, 2I, H),
`experts.down_proj` (E, H, I)), not linear layers, so `target_modules` cannot reach them:
`all-linear` means the linear layers outside the experts (attention, dense MLP layers), and a
target that names no linear layer of the model is an error naming the ones it has.

The experts take adapters through `target_parameters` (PEFT's name; its `ParamWrapper`, one per
adapted parameter, nested when both are): each expert gets its own A (r, in) and B (out, r), all
experts' A stacked in one `lora_A` (E r, in) and their B interleaved in one `lora_B` (out, r E).
The trainer's forward multiplies by W_e + alpha / r B_e A_e. PEFT cannot apply dropout to a
parameter's input, so expert adapters need `lora_dropout: 0`. Rollout engines: the native engine
adds the experts' low-rank products in its own forward (`grpoflow.models.moe_adapters`);
every other engine gets the merged weights (`adapted_parameters` tells `merged_weights` which
parameters to merge), never the adapters alone (`grpoflow.engines.vllm_adapters.expert_adapter_obstacle`).
"""

from __future__ import annotations

from torch import nn

from grpoflow.policy.routing_replay import is_moe_config


def is_moe_model(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return config is not None and is_moe_config(config)


def linear_targets(model: nn.Module) -> list[str]:
    """The last names of the model's linear layers outside its experts and output head, sorted."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not head and ".experts." not in f".{name}."
        }
    )


def moe_lora_targets(model: nn.Module, targets: list[str] | str) -> list[str] | str:
    """The target modules a MoE `model`'s adapters go on (`targets` unchanged for a dense model):
    `all-linear` as its linear layers outside the experts; named ones checked against those."""
    if not is_moe_model(model):
        return targets
    linear = linear_targets(model)
    if isinstance(targets, str):
        return linear
    missing = [name for name in targets if name not in linear]
    if missing:
        raise ValueError(
            f"target_modules {missing} name no linear layer of this mixture-of-experts model: its experts "
            f"are fused parameters (experts.gate_up_proj, experts.down_proj), adapted through "
            f"target_parameters; target its linear layers ({', '.join(linear)}) or all-linear"
        )
    return targets


def expert_parameters(model: nn.Module) -> list[str]:
    """The model's fused expert parameters (3-D), named by their module's last name and their own
    (`experts.gate_up_proj`), sorted."""
    return sorted(
        {
            ".".join(name.split(".")[-2:])
            for name, parameter in model.named_parameters()
            if parameter.dim() == 3
        }
    )


def check_target_parameters(model: nn.Module, targets: list[str]) -> None:
    """Raise unless every name in `targets` names fused expert parameters of `model` (as PEFT
    matches them: the parameter's full name, or its end after a dot)."""
    full = [name for name, parameter in model.named_parameters() if parameter.dim() == 3]
    missing = [
        target
        for target in targets
        if not any(name == target or name.endswith(f".{target}") for name in full)
    ]
    if not missing:
        return
    if not full:
        raise ValueError(
            f"target_parameters {missing}: this model has no fused expert parameters (it is not a "
            "mixture-of-experts model); adapt its linear layers with target_modules"
        )
    raise ValueError(
        f"target_parameters {missing} name no fused expert parameter of this model: it has "
        f"{', '.join(expert_parameters(model))}"
    )


def adapted_parameters(layer: nn.Module) -> dict[str, nn.Module]:
    """The base parameters the PEFT LoRA layer `layer` adapts, by name, each with the layer holding
    its adapters: a linear layer's `weight`; for nested `ParamWrapper`s (a module's fused
    parameters), each wrapper's parameter."""
    adapted: dict[str, nn.Module] = {}
    while hasattr(layer, "lora_A"):
        name = getattr(layer, "parameter_name", None)
        adapted[name or "weight"] = layer
        if name is None:
            break
        layer = layer.base_layer
    return adapted


def refuse_moved_targets(
    peft_model: nn.Module, targets: list[str] | str, target_parameters: list[str]
) -> None:
    """Raise when PEFT moved module targets onto fused expert parameters: for MoE models whose
    experts transformers v5 fused, it reads the linear names of a dense MLP (`gate_proj`, `up_proj`,
    `down_proj`, also those of dense layers or shared experts) as the old names of the experts and
    adapts the experts instead, at twice the rank for `gate_up_proj`."""
    final = peft_model.peft_config[peft_model.active_adapter]
    added = sorted(set(final.target_parameters or ()) - set(target_parameters))
    if not added:
        return
    asked = [targets] if isinstance(targets, str) else targets
    moved = sorted(set(asked) - set(final.target_modules or ()))
    raise ValueError(
        f"target_modules {moved}: on this mixture-of-experts model PEFT takes these names for its fused "
        f"experts and would adapt {', '.join(added)} in place of those linear layers; leave them out of "
        "target_modules (list the other modules instead of all-linear) and adapt the experts with "
        "target_parameters"
    )
