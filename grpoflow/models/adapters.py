"""LoRA adapters applied inside the native forward: `y = x W^T + scale * (x A^T) B^T`.

A LoRA policy reaches the engine as its base model with PEFT's LoRA layers in place of the
adapted linear layers. The family forward multiplies by each base weight as it is and adds every
adapter's low-rank product to that projection's output (one `addmm_` per adapter, into the output
slice itself). Where the engine fuses q/k/v or gate/up (`fusion`), the adapters' A matrices of the
group are laid back to back too, so the group's x A^T is one product; the B products stay one per
projection, each added into its own columns of the fused output.

Why not merge `W + scale * B A` into the base weights around each rollout, as `policy.lora`'s
`merged_adapters` does for engines that need a merged module:

- exactness: a merge rounds W + dW to W's dtype, and subtracting dW again does not give W back
  (bfloat16 loses up to an ulp per merge), so the base has to be saved and restored: a CPU copy of
  every adapted weight per rollout (12.7 s of a 22.9 s step for a Qwen2.5-7B shape on an H100), or
  a spare GPU copy (15 GB for 7B, the memory LoRA is chosen to save). Here the base is only read.
- cost: at rank 16 on all linear layers of a 7B model the adapters are 40 M parameters, 0.5% of
  the bytes a decode step reads for the base weights; the products add eleven small kernels
  per layer (fused q/k/v and gate/up), replayed inside the decode step's CUDA graph. Adapters in
  the base's dtype are read from their own storage, which the optimizer updates in place, so a
  graph never goes stale; PEFT's float32 adapters on a bfloat16 base are multiplied through
  copies in bfloat16 (`attach_copies`, 80 MB at 7B), rewritten before a rollout that follows an
  optimizer step, as the trainer multiplies them (`grpoflow.policy.lora_precision`): in float32
  every product would cast its input and its output, twice the kernels.
- fidelity: the trainer scores completions with PEFT's unmerged forward; a bfloat16 merge drops
  the parts of dW below half an ulp of W, the low-rank product keeps them.

Only plain LoRA is read here (one or more active adapters, no DoRA or other variant, no bias on
B, nothing merged); a layer with anything else sends the model to the generic path, which runs
PEFT's own forward. LoRA dropout does not apply: the engine generates, it does not train.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from grpoflow.models.fusion import alias_rows, rows_view


@dataclass(slots=True)
class Term:
    """One adapter of one projection: its `lora_A` and `lora_B` linear modules and scale.

    The weights are read from the modules at every forward (A (r, in), B (out, r)), so an
    optimizer step or a gathered shard is seen as the base weights are. Adapters held in another
    dtype than the base (PEFT's float32 on a bfloat16 model) are multiplied through `copies` in the
    base's dtype, as the trainer's forward multiplies them (`grpoflow.policy.lora_precision`);
    `refresh_copies` writes them again before a rollout when the weights' values have changed."""

    down: nn.Module | Matrix
    up: nn.Module | Matrix
    scale: float
    copies: tuple[torch.Tensor, torch.Tensor] | None = None
    cast_input: bool = False
    """The layer casts its input to A's dtype first (PEFT's default; `lora_precision` turns it off)."""

    @property
    def down_weight(self) -> torch.Tensor:
        return self.down.weight if self.copies is None else self.copies[0]

    @property
    def up_weight(self) -> torch.Tensor:
        return self.up.weight if self.copies is None else self.copies[1]


@dataclass(slots=True)
class Matrix:
    """A loaded adapter matrix, held as a module holds its weight."""

    weight: torch.Tensor


def loaded_term(down: torch.Tensor, up: torch.Tensor, like: torch.Tensor, previous: Term | None) -> Term:
    """An adapter sent as tensors (A (r, in), B (out, r) already scaled; see
    `grpoflow.transport.adapters`) on `like`'s device and dtype. Written into `previous`'s storage
    when the shapes agree, so captured graphs and fused views stay valid."""
    if previous is not None and (previous.down.weight.shape, previous.up.weight.shape) == (
        down.shape,
        up.shape,
    ):
        previous.down.weight.copy_(down)
        previous.up.weight.copy_(up)
        return previous
    placed = {"device": like.device, "dtype": like.dtype}
    return Term(Matrix(down.to(**placed, copy=True)), Matrix(up.to(**placed, copy=True)), 1.0)


@dataclass(slots=True)
class Projection:
    """The adapters of one projection (empty: a plain linear layer)."""

    terms: list[Term] = field(default_factory=list)


def is_lora_layer(module: nn.Module) -> bool:
    """Whether `module` is a PEFT LoRA layer (read by its attributes: the engine imports no PEFT)."""
    return isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and hasattr(module, "base_layer")


def supported(module: nn.Module) -> bool:
    """Whether the engine can apply `module`'s adapters itself: a plain linear layer, or a LoRA
    layer of plain LoRA adapters."""
    if not is_lora_layer(module):
        return not hasattr(module, "lora_embedding_A")
    if getattr(module, "fan_in_fan_out", False):
        return False
    for name in _active(module):
        if name in getattr(module, "lora_variant", {}) or getattr(module, "lora_bias", {}).get(name):
            return False
        if not isinstance(module.lora_A[name], nn.Linear) or module.lora_B[name].bias is not None:
            return False
    return True


def projection_of(module: nn.Module, loaded: Term | None = None) -> Projection:
    """The adapters the engine adds to `module`'s output: those of a PEFT LoRA layer (none when
    they are merged into its base weight or switched off), else the adapter `loaded` for it."""
    if not is_lora_layer(module):
        return Projection([loaded] if loaded is not None else [])
    if module.merged or module.disable_adapters:
        return Projection()
    casts = getattr(module, "cast_input_dtype_enabled", True)
    return Projection(
        terms=[
            Term(module.lora_A[name], module.lora_B[name], float(module.scaling[name]), cast_input=casts)
            for name in _active(module)
        ]
    )


def adapter_state(module: nn.Module) -> tuple:
    """What decides `projection_of(module)` besides the weights: merged, switched off, which
    adapters are active. The engine finds the adapters again when it changes."""
    if not is_lora_layer(module):
        return ()
    return (bool(module.merged), bool(module.disable_adapters), tuple(_active(module)))


def _active(module: nn.Module) -> list[str]:
    return [name for name in module.active_adapters if name in module.lora_A]


def alias_down(projections: Sequence[Projection]) -> None:
    """Lay the A matrices of sibling projections (one adapter each) back to back, as `alias_rows`
    does for their base weights, so the group's x A^T is one product."""
    if _one_term_each(projections):
        alias_rows([projection.terms[0].down.weight for projection in projections])


def fused_down(projections: Sequence[Projection]) -> torch.Tensor | None:
    """The group's A matrices (in the dtype they are multiplied in) as one (sum of ranks, in)
    view, when they lie back to back."""
    if not _one_term_each(projections):
        return None
    return rows_view([projection.terms[0].down_weight for projection in projections])


def attach_copies(
    groups: Sequence[Sequence[Projection]], dtype: torch.dtype, previous: dict[tuple, list[torch.Tensor]]
) -> dict[tuple, list[torch.Tensor]]:
    """Give every adapter held in another dtype than `dtype` its `copies` in `dtype` (the A copies
    of a group of one-adapter projections back to back, for `fused_down`), written as it is made.
    A group whose weights are where they were keeps its copies from `previous`, so captured graphs
    stay valid; `refresh_copies` writes them again when the weights' values change. Returns the
    copies by group, for the next call."""
    copies = {}
    for group in groups:
        terms = [term for projection in group for term in projection.terms]
        if all(term.down.weight.dtype == term.up.weight.dtype == dtype for term in terms):
            continue
        key = tuple((w.data_ptr(), w.shape) for term in terms for w in (term.down.weight, term.up.weight))
        made = previous.get(key)
        fresh = made is None
        if fresh:
            made = _new_copies(terms, dtype, fused=_one_term_each(group))
        for index, term in enumerate(terms):
            term.copies = (made[2 * index], made[2 * index + 1])
        if fresh:
            refresh_copies(terms)
        copies[key] = made
    return copies


def _new_copies(terms: Sequence[Term], dtype: torch.dtype, *, fused: bool) -> list[torch.Tensor]:
    """[A copy, B copy] per term; the A copies in one buffer when `fused`."""
    downs = [term.down.weight for term in terms]
    if fused and len({(w.device, w.shape[1:]) for w in downs}) == 1:
        rows = [w.shape[0] for w in downs]
        buffer = torch.empty((sum(rows), *downs[0].shape[1:]), dtype=dtype, device=downs[0].device)
        parts = list(buffer.split(rows))
    else:
        parts = [torch.empty_like(w, dtype=dtype) for w in downs]
    return [
        t for term, down in zip(terms, parts) for t in (down, torch.empty_like(term.up.weight, dtype=dtype))
    ]


def refresh_copies(terms: Sequence[Term]) -> None:
    """Write the adapters' current values into their `copies` (see `attach_copies`)."""
    pairs = [
        (weight.detach(), copy)
        for term in terms
        if term.copies is not None
        for weight, copy in zip((term.down.weight, term.up.weight), term.copies)
    ]
    if pairs:
        with torch.no_grad():
            torch._foreach_copy_([copy for _, copy in pairs], [weight for weight, _ in pairs])


def _one_term_each(projections: Sequence[Projection]) -> bool:
    return bool(projections) and all(len(projection.terms) == 1 for projection in projections)


def add_low_rank(
    outputs: Sequence[torch.Tensor],
    x: torch.Tensor,
    projections: Sequence[Projection],
    down: torch.Tensor | None = None,
) -> None:
    """Add each projection's adapters into its output, in place: `out += scale * (x A^T) B^T`.

    x (T, in); `outputs[i]` (T, out_i), views of one fused product allowed; `down` the fused A
    of the group (`fused_down`), or None to multiply by each A on its own.
    """
    if down is not None:
        ranks = [projection.terms[0].down_weight.shape[0] for projection in projections]
        parts = F.linear(x.to(down.dtype), down).split(ranks, -1)
        for out, part, projection in zip(outputs, parts, projections):
            _add(out, part, projection.terms[0])
        return
    for out, projection in zip(outputs, projections):
        for term in projection.terms:
            weight = term.down_weight
            _add(out, F.linear(x.to(weight.dtype), weight), term)


def _add(out: torch.Tensor, part: torch.Tensor, term: Term) -> None:
    up = term.up_weight
    if up.dtype == out.dtype:
        out.addmm_(part, up.t(), alpha=term.scale)
    else:  # adapters in another dtype than the output's and no copies: summed in theirs, rounded once
        out.add_(F.linear(part, up), alpha=term.scale)
