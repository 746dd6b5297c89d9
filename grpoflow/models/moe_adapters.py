"""LoRA adapters on a sparse layer's fused experts, added inside the family forward (`moe`).

PEFT adapts a fused expert parameter W (E, out, in) (`target_parameters`) with a `ParamWrapper`
(nested when both of a layer's parameters are adapted) holding one `lora_A` (E r, in), whose rows
e r .. (e + 1) r are expert e's A_e, and one `lora_B` (out, r E), which is (out, r, E) with expert
e's B_e at e of the last dimension. Its forward multiplies by W_e + scale B_e A_e. Here, as
`adapters` does for linear layers, nothing is merged: the rows routed to expert e get
`y_e += scale (x_e A_e^T) B_e^T` beside their product with W_e, as two more grouped products with
the base products' offsets on CUDA, or in the reference loop.

The products read copies in the experts' dtype, A (E, r', in) and B (E, out, r') with each
expert's matrix contiguous, as `torch._grouped_mm` takes them (PEFT's B interleaves the experts),
the rank padded with zeros to a multiple of 8 (rows of 16 bytes in bfloat16; the zeros add
nothing). A copy keeps its storage while its adapter's weights stay where they are, so captured
CUDA graphs stay valid, and `refresh` writes it again before a rollout that follows a change of
the weights' values (the engine's version check), as `adapters.attach_copies` does for float32
adapters of linear layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from grpoflow.models.adapters import is_lora_layer

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
"""The fused expert parameters whose adapters the family forward adds."""
RANK_ALIGNMENT = 8


@dataclass(slots=True)
class ExpertTerm:
    """One adapter of one fused expert parameter and its per-expert copies."""

    lora_A: nn.Module
    lora_B: nn.Module
    scale: float
    rank: int
    down: torch.Tensor
    """(E, r', in): A_e, rows past `rank` zero."""
    up: torch.Tensor
    """(E, out, r'): B_e, columns past `rank` zero."""

    def key(self) -> tuple:
        """Where the adapter's weights lie: a term whose key is unchanged keeps its copies."""
        return tuple((w.data_ptr(), w.shape, w.dtype) for w in (self.lora_A.weight, self.lora_B.weight))

    def refresh(self) -> None:
        """Write the adapter's current values into the copies."""
        experts, rank = self.down.shape[0], self.rank
        down, up = self.lora_A.weight.detach(), self.lora_B.weight.detach()
        self.down[:, :rank].copy_(down.view(experts, rank, -1))
        self.up[:, :, :rank].copy_(up.view(up.shape[0], rank, experts).permute(2, 0, 1))


@dataclass(slots=True)
class ExpertAdapters:
    """The adapters of a sparse layer's experts by parameter (both empty: none)."""

    gate_up: list[ExpertTerm] = field(default_factory=list)
    down: list[ExpertTerm] = field(default_factory=list)

    @property
    def terms(self) -> list[ExpertTerm]:
        return [*self.gate_up, *self.down]

    def refresh(self) -> None:
        with torch.no_grad():
            for term in self.terms:
                term.refresh()


def base_experts(module: nn.Module) -> nn.Module:
    """The experts module itself under PEFT's wrappers (`module` when it has none)."""
    while is_lora_layer(module):
        module = module.base_layer
    return module


def expert_wrappers(module: nn.Module) -> dict[str, nn.Module]:
    """PEFT's wrappers of the experts module `module`, by the name of the parameter each adapts."""
    wrappers = {}
    while is_lora_layer(module):
        wrappers[getattr(module, "parameter_name", "")] = module
        module = module.base_layer
    return wrappers


def expert_refusal(module: nn.Module) -> str | None:
    """Why the family forward cannot add the adapters on the experts module `module` (as PEFT
    wrapped it); None when it can (or there are none)."""
    experts = base_experts(module)
    for name, wrapper in expert_wrappers(module).items():
        if name not in EXPERT_PARAMETERS:
            return f"LoRA adapters on the experts' {name or 'module'} (the family path adapts {', '.join(EXPERT_PARAMETERS)})"
        parameter = getattr(experts, name)
        for adapter in _active(wrapper):
            down, up = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
            if adapter in getattr(wrapper, "lora_variant", {}) or wrapper.lora_bias.get(adapter):
                return f"an adapter of experts.{name} with a variant or a bias"
            if not isinstance(down, nn.Linear) or not isinstance(up, nn.Linear) or up.bias is not None:
                return f"an adapter of experts.{name} other than two matrices"
            num_experts, out_features, in_features = parameter.shape
            rows = down.weight.shape[0]
            if (
                rows % num_experts
                or down.weight.shape[1] != in_features
                or up.weight.shape != (out_features, rows)
            ):
                return f"an adapter of experts.{name} of shapes {tuple(down.weight.shape)}, {tuple(up.weight.shape)}"
    return None


def expert_adapters(module: nn.Module, previous: ExpertAdapters | None = None) -> ExpertAdapters:
    """The adapters the family forward adds to the experts of `module` (PEFT's wrapper of them, or
    the experts themselves): none when merged into the weights or switched off. A term whose
    weights lie where they lay in `previous` keeps its copies; new ones are written at once."""
    experts = base_experts(module)
    kept = {term.key(): term for term in (previous.terms if previous is not None else [])}
    found = ExpertAdapters()
    for name, wrapper in expert_wrappers(module).items():
        if wrapper.merged or wrapper.disable_adapters:
            continue
        parameter = getattr(experts, name)
        for adapter in _active(wrapper):
            term = _term(wrapper, adapter, parameter, kept)
            getattr(found, name.removesuffix("_proj")).append(term)
    return found


def _term(
    wrapper: nn.Module, adapter: str, parameter: torch.Tensor, kept: dict[tuple, ExpertTerm]
) -> ExpertTerm:
    down, up = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
    key = tuple((w.data_ptr(), w.shape, w.dtype) for w in (down.weight, up.weight))
    scale = float(wrapper.scaling[adapter])
    if key in kept and kept[key].down.dtype == parameter.dtype:
        term = kept[key]
        term.scale = scale
        return term
    num_experts, out_features, in_features = parameter.shape
    rank = down.weight.shape[0] // num_experts
    padded = -(-rank // RANK_ALIGNMENT) * RANK_ALIGNMENT
    placed = {"device": parameter.device, "dtype": parameter.dtype}
    term = ExpertTerm(
        lora_A=down,
        lora_B=up,
        scale=scale,
        rank=rank,
        down=torch.zeros(num_experts, padded, in_features, **placed),
        up=torch.zeros(num_experts, out_features, padded, **placed),
    )
    with torch.no_grad():
        term.refresh()
    return term


def _active(wrapper: nn.Module) -> list[str]:
    return [name for name in wrapper.active_adapters if name in wrapper.lora_A]


def add_grouped(out: torch.Tensor, x: torch.Tensor, terms: list[ExpertTerm], offsets: torch.Tensor) -> None:
    """`out += scale (x A_e^T) B_e^T` for each term, over rows sorted by expert (`offsets`: each
    expert's end row), as two grouped products a term."""
    for term in terms:
        part = torch._grouped_mm(x, term.down.transpose(1, 2), offs=offsets)
        out.add_(torch._grouped_mm(part, term.up.transpose(1, 2), offs=offsets), alpha=term.scale)


def add_expert(out: torch.Tensor, x: torch.Tensor, expert: int, terms: list[ExpertTerm]) -> None:
    """`out += scale (x A_e^T) B_e^T` for each term, for the rows x (T, in) routed to `expert`."""
    for term in terms:
        down, up = term.down[expert, : term.rank], term.up[expert, :, : term.rank]
        out.addmm_(x @ down.t(), up.t(), alpha=term.scale)
