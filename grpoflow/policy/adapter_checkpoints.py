"""Adapter-only checkpoints of a LoRA policy: recognising them, loading one into a PeftModel
after checking it was trained with the same adapter settings, and merging one into a plain model
(evaluation, export)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

ADAPTER_CONFIG = "adapter_config.json"
"""The file PEFT's `save_pretrained` writes beside the adapter weights; it marks an adapter checkpoint."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""The adapter weights PEFT's `save_pretrained` writes."""


def is_adapter_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def load_adapter_weights(model: nn.Module, directory: str | Path) -> None:
    """Load the adapter of an adapter checkpoint into the PeftModel `model`, after checking that
    it was trained with the same adapter settings."""
    from peft import LoraConfig, set_peft_model_state_dict
    from safetensors.torch import load_file

    directory = Path(directory)
    adapter = model.active_adapter
    _check_same_adapter(LoraConfig.from_pretrained(str(directory)), model.peft_config[adapter], directory)
    device = next(model.parameters()).device
    state = load_file(str(directory / ADAPTER_WEIGHTS), device=str(device))
    result = set_peft_model_state_dict(model, state, adapter_name=adapter)
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    missing = sorted(trainable & set(result.missing_keys))
    if result.unexpected_keys or missing:
        raise ValueError(
            f"adapter checkpoint {directory} does not match the model (missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}): resume with the model the run started from"
        )


def merge_adapter_checkpoint(base: nn.Module, directory: str | Path) -> nn.Module:
    """The plain model `base` with the adapter saved in `directory` merged into its weights."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(directory)).merge_and_unload()


_ADAPTER_SETTINGS = {
    "r": "lora_rank",
    "lora_alpha": "lora_alpha",
    "target_modules": "target_modules",
    "target_parameters": "target_parameters",
    "modules_to_save": "modules_to_save",
}
"""PEFT's LoraConfig fields a resumed run must share with its checkpoint, by grpoflow key."""


def _check_same_adapter(saved, current, directory: Path) -> None:
    for name, key in _ADAPTER_SETTINGS.items():
        was, now = _comparable(getattr(saved, name)), _comparable(getattr(current, name))
        if was != now:
            raise ValueError(
                f"checkpoint {directory} was trained with {key}={was} but this run has {key}={now}: "
                "resume with the adapter settings the run started with"
            )


def _comparable(value):
    if value is None:
        return []
    if isinstance(value, list | set | tuple):
        return sorted(value)
    return value
