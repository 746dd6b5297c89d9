"""LoRA targets of a mixture-of-experts policy.

transformers stores a MoE layer's experts as fused parameters (`experts.gate_up_proj`,
`experts.down_proj`), not linear layers. PEFT can adapt them (its `ParamWrapper`), but grpoflow
merges and sends only linear layers' adapters to rollout engines, so the engines would sample
from weights without the experts' adapters. A MoE policy's adapters therefore go on its linear
layers outside the experts: `all-linear` means those (attention, dense MLP layers), and a target
that names no linear layer of the model is an error naming the ones it has.
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
            f"are fused parameters (experts.gate_up_proj, experts.down_proj) that LoRA here does not adapt; "
            f"target its linear layers ({', '.join(linear)}) or all-linear"
        )
    return targets


def refuse_expert_adapters(model: nn.Module) -> None:
    """Raise when PEFT put adapters on fused expert parameters (module docstring)."""
    wrapped = [name for name, module in model.named_modules() if type(module).__name__ == "ParamWrapper"]
    if wrapped:
        raise ValueError(
            f"LoRA adapters landed on fused expert parameters ({wrapped[0]}), which rollout engines would "
            "not receive: target the model's linear layers (q_proj, k_proj, v_proj, o_proj) or all-linear"
        )
