"""A LoRA policy's adapters in a colocated vLLM, loaded through vLLM's own LoRA support.

The engine is built with `enable_lora=True` and keeps the frozen base as the policy holds it; each
sync hands it the adapters as `grpoflow.transport.adapters` names them (A, and B already times
alpha / r). They are written as a PEFT adapter directory (alpha = r, so vLLM's scaling is 1),
overwritten at each sync, and generation runs with a `LoRARequest` whose id and name are new at
each sync, so vLLM loads the new version instead of serving the cached one (vLLM 0.32 loads
adapters from a path only). Not `load_inplace` under the old id: vLLM's prefix cache keys blocks
by the adapter's name and path, so they would outlive the version they were computed with.

What a LoRA adapter cannot carry keeps the merged full sync (`adapter_obstacle` says why):
`modules_to_save` (modules trained in full), adapters on fused expert parameters, DoRA, and
adapters on embeddings.

PEFT and vLLM are imported only when a LoRA policy meets the vLLM engine.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import typing
from pathlib import Path

import torch
from torch import nn

from grpoflow.transport.adapters import DOWN, UP

PEFT_PREFIX = "base_model.model."
"""The prefix of a module's name in PEFT's adapter files."""


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The PEFT LoRA layers of `model` by name (none without importing PEFT when no one has)."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.lora import LoraLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def adapter_obstacle(model: nn.Module) -> str | None:
    """Why the adapters of `model` (a model with PEFT layers) cannot travel to vLLM as a LoRA
    adapter, or None when they can."""
    from peft.utils.other import ModulesToSaveWrapper

    if any(isinstance(module, ModulesToSaveWrapper) for module in model.modules()):
        return "modules_to_save are trained in full, which a LoRA adapter cannot carry"
    experts = expert_adapter_obstacle(model)
    if experts is not None:
        return experts
    for name, layer in lora_layers(model):
        if any(layer.use_dora.values()):
            return f"{name} uses DoRA, which vLLM does not load"
        if layer.lora_embedding_A:
            return f"{name} adapts an embedding, which vLLM's adapters from PEFT do not cover"
    return None


def expert_adapter_obstacle(model: nn.Module) -> str | None:
    """Why `model`'s adapters cannot travel alone to any engine with its own copy of the base:
    adapters on fused expert parameters (PEFT's `ParamWrapper`, `target_parameters`), which no
    engine loads as an adapter, so they travel merged; None when there are none."""
    for name, module in model.named_modules():
        if type(module).__name__ == "ParamWrapper":
            return f"{name} adapts fused expert parameters (target_parameters), which travel merged"
    return None


def adapter_rank(model: nn.Module) -> int:
    """The largest rank over the LoRA layers of `model` (several active adapters add up)."""
    ranks = [
        sum(layer.r[adapter] for adapter in layer.active_adapters if adapter in layer.lora_A)
        for _, layer in lora_layers(model)
    ]
    return max(ranks, default=0)


def vllm_max_lora_rank(
    rank: int, option: str = "lora_rank", fix: str = "lower lora_rank, or use rollout_engine=native"
) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank` (vLLM takes a fixed set); a
    ValueError naming `option` and its `fix` when none does."""
    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(typing.get_args(MaxLoRARanks))
    fitting = [value for value in allowed if value >= rank]
    if not fitting:
        raise ValueError(f"{option}={rank} is above the largest rank vLLM serves ({allowed[-1]}): {fix}")
    return fitting[0]


def plain_base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of a model with PEFT layers as the model without them names it, with the
    base weights as loaded (unmerged) and no adapter weights: what vLLM builds the engine from."""
    state = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name or ".modules_to_save." in name:
            continue
        state[name.replace(".base_layer.", ".").replace(".original_module.", ".")] = tensor
    return state


def pad_rank(down: torch.Tensor, up: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (r, in) and B (out, r) as rank `rank` >= r: zero rows of A and zero columns of B, so
    B A is unchanged."""
    missing = rank - down.shape[0]
    if missing == 0:
        return down, up
    return (
        torch.cat([down, down.new_zeros(missing, down.shape[1])]),
        torch.cat([up, up.new_zeros(up.shape[0], missing)], 1),
    )


def check_pairs(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """ValueError unless each module's A and B are (r, in) and (out, r) of one rank: vLLM would
    take any pair, then fail to load it at the next generation."""
    for module, (down, up) in adapters.items():
        if down.dim() != 2 or up.dim() != 2 or down.shape[0] != up.shape[1]:
            raise ValueError(
                f"the adapter of {module} has A {tuple(down.shape)} and B {tuple(up.shape)}: "
                "they must be (r, in) and (out, r) of one rank r"
            )


def adaptable_modules(worker) -> list[str]:
    """Run in vLLM's worker (`LLM.collective_rpc`) of an engine built with LoRA: the names (last
    part, Hugging Face's) of the layers its adapters may adapt, e.g. q_proj for vLLM's fused
    qkv_proj. An adapter of any other layer (an embedding, the output head) fails when vLLM
    loads it, at the next generation, so the server refuses it at the update."""
    manager = worker.model_runner.lora_manager._adapter_manager
    packed = manager.packed_modules_mapping
    return sorted(
        {part for module in manager.supported_lora_modules for part in packed.get(module, [module])}
    )


def write_peft_adapter(directory: Path, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Save `adapters` ({module: (A (r, in), B (out, r) scaled)}, Hugging Face module names) as a
    PEFT adapter directory vLLM loads (alpha = r: B already carries alpha / r). vLLM loads one
    rank per adapter: a module of a lower rank is padded with zeros to the largest (the same
    product)."""
    from safetensors.torch import save_file

    check_pairs(adapters)
    directory.mkdir(parents=True, exist_ok=True)
    rank = max(down.shape[0] for down, _ in adapters.values())
    tensors = {}
    for module, (down, up) in adapters.items():
        down, up = pad_rank(down.detach().to("cpu"), up.detach().to("cpu"), rank)
        tensors[f"{PEFT_PREFIX}{module}{DOWN}"] = down.contiguous()
        tensors[f"{PEFT_PREFIX}{module}{UP}"] = up.contiguous()
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = dict(
        peft_type="LORA",
        task_type="CAUSAL_LM",
        r=rank,
        lora_alpha=rank,  # B arrives already times alpha / r
        target_modules=sorted({module.rsplit(".", 1)[-1] for module in adapters}),
        bias="none",
        modules_to_save=None,
    )
    (directory / "adapter_config.json").write_text(json.dumps(config))


class AdapterSlot:
    """The one adapter vLLM generates with: a PEFT directory rewritten at each `write`, and the
    `LoRARequest` naming its current version (None: generate with the base alone)."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="grpoflow-vllm-adapter-"))
        self.request = None
        self._next_id = 1

    def write(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Save `adapters` (`write_peft_adapter`) and point the request at them under a new id."""
        write_peft_adapter(self.directory, adapters)
        self.renew()

    def renew(self) -> None:
        """Name the directory's adapter under a new id, so vLLM loads it again (its cached copy is
        of an older version, or was freed by a level-2 sleep)."""
        from vllm.lora.request import LoRARequest

        version = self._next_id
        self._next_id += 1
        self.request = LoRARequest(f"policy-{version}", version, str(self.directory))

    def clear(self) -> None:
        """Generate with the base alone (the weights arrived merged)."""
        self.request = None

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
