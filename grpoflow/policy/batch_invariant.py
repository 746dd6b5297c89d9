"""The policy's training forward on the batch-invariant kernels (`batch_invariant`): its linear
layers (the output head and a LoRA policy's adapter matrices included), RMSNorms (Qwen3's per-head
q/k norms too), attention and a Qwen3-MoE policy's routers and experts computed by
`grpoflow.kernels`' kernels, whose every row is bit-identical however many rows share the forward.
A sparse block's router scores the experts by the kernels' product and routes by
`batch_invariant_moe.route`; the block runs its experts' parameters (`gate_up_proj`, `down_proj`,
which keep their names and gradients) by `batch_invariant_moe.experts`, as the native engine does. A
LoRA policy's PEFT layers keep their own forward, which then runs its products on the kernels.

With the native engine's batch-invariant forward (`NativeEngineConfig.batch_invariant`), which
runs the same weights through the same kernels over its paged cache, the engine's logits for a
token are the trainer's bit for bit. Under `on_policy_sampling` the trainer's replay then agrees
with every keyed draw of the engine, so one round suffices.

`BatchInvariantKernels.install` sets each module's forward on its instance (the class is left
alone), the rotary module's to an index into one table of every position (`rotary_tables`), each
attention module's to its class forward seeing `kernels.rotary` (eager's forward, one kernel each
for the recompute and the backward), each SwiGLU MLP's to one with the native engine's SiLU-and-
product kernel (`kernels.swiglu`), and the attention implementation to one registered with
transformers; `remove` restores them all. Backward passes need not be invariant: fused kernels or
torch's, and a checkpointed layer's recompute runs on torch's products and flash attention
(`kernels.recompute`). torch.compile would fuse the elementwise operations between the kernels
and change their rounding, so it is refused.
"""

from __future__ import annotations

import functools
import logging
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from grpoflow.policy.function_globals import with_globals
from grpoflow.policy.lora_precision import InputDtypeLinear

NAME = "grpoflow_batch_invariant"
"""The attention implementation's name in transformers' registry."""

logger = logging.getLogger("grpoflow")


def wanted(setting: bool | str, on_policy_sampling: bool, device: torch.device) -> bool:
    """Whether the kernels run: True, False, or 'auto' (on with on_policy_sampling on CUDA)."""
    if setting == "auto":
        return on_policy_sampling and torch.device(device).type == "cuda"
    return setting is True


def install_if_wanted(
    setting: bool | str,
    on_policy_sampling: bool,
    model: nn.Module,
    torch_compile: bool,
    use_liger_kernel: bool = False,
) -> BatchInvariantKernels | None:
    """The kernels on `model` when `setting` asks for them (`wanted`). True refuses a model or a
    torch_compile they cannot serve; auto leaves them off then, and beside Liger's kernels
    (`use_liger_kernel`, which replace the same modules), with one log line."""
    if not wanted(setting, on_policy_sampling, next(model.parameters()).device):
        return None
    if setting == "auto":
        from grpoflow.models.batch_invariant import refusal
        from grpoflow.policy.lora import generation_model

        if use_liger_kernel:
            reason = "use_liger_kernel is on"
        else:
            reason = "torch_compile is on" if torch_compile else refusal(generation_model(model))
        if reason is not None:
            logger.info("batch_invariant: auto leaves the batch-invariant kernels off (%s)", reason)
            return None
    return BatchInvariantKernels.install(model, torch_compile)


def installed(model: nn.Module) -> bool:
    """Whether `model` runs on the kernels (its attention implementation is theirs)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME


def scores_match(model: nn.Module) -> bool:
    """The native engine's scores of its draws are the update's bit for bit: the kernels run on
    `model` and its output head is a plain linear layer on them, which the update scores on the
    fused path as the engine does (`algo.logprobs.invariant_token_logprobs`); an adapted head is
    scored by its own forward."""
    from grpoflow.algo.logprobs import head_product
    from grpoflow.kernels.batch_invariant import matmul_forward
    from grpoflow.policy.lora import generation_model

    model = generation_model(model)
    return installed(model) and head_product(model.get_output_embeddings()) is matmul_forward


def attention_function(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over `batch_invariant_attention.attention`: each query
    attends its own sequence, which its position gives (padding counts from 0, packed sequences
    start over); the mask is not read."""
    from grpoflow.kernels import batch_invariant_attention as ba

    if kwargs.get("sliding_window") is not None or dropout:
        raise ValueError(f"{NAME} has no sliding window or attention dropout; set batch_invariant: false")
    length = query.shape[2]
    positions = position_ids if position_ids is not None else torch.arange(length, device=query.device)[None]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return ba.attention(query, key, value, positions, scale), None


def register() -> None:
    """Register `attention_function` (and the sdpa mask, which it ignores) under NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, attention_function)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    from grpoflow.kernels.batch_invariant import matmul

    return matmul(x, self.weight, self.bias)


def _input_dtype_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`lora_precision.InputDtypeLinear`'s forward: the weight cast to the input's dtype."""
    from grpoflow.kernels.batch_invariant import matmul

    bias = None if self.bias is None else self.bias.to(x.dtype)
    return matmul(x, self.weight.to(x.dtype), bias)


def _rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from grpoflow.kernels.batch_invariant import rms_norm

    return rms_norm(x, self.weight, self.variance_epsilon)


def _router_forward(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """transformers' Qwen3-MoE router on the kernels: (logits, weights, experts)."""
    from grpoflow.kernels.batch_invariant import matmul
    from grpoflow.kernels.batch_invariant_moe import route

    logits = matmul(hidden_states.reshape(-1, self.weight.shape[1]), self.weight)
    weights, chosen = route(logits, self.top_k, bool(self.norm_topk_prob))
    return logits, weights, chosen


def _sparse_block_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3-MoE sparse block: its router (a module call, so its hooks run), then
    its experts' parameters by `batch_invariant_moe.experts`."""
    from grpoflow.kernels.batch_invariant_moe import experts

    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    _, weights, chosen = self.gate(flat)
    out = experts(flat, self.experts.gate_up_proj, self.experts.down_proj, chosen, weights)
    return out.view(hidden_states.shape)


def _rotary_forward(
    tables: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = (table.to(position_ids.device)[position_ids] for table in tables)
    return cos.to(x.dtype), sin.to(x.dtype)


SILU_MODULES = frozenset({"SiLU", "SiLUActivation"})
"""torch's and transformers' SiLU modules (an MLP's `act_fn`)."""


def _is_swiglu_mlp(module: nn.Module) -> bool:
    """A dense gated MLP with SiLU, `down(act(gate(x)) * up(x))` (Qwen2, Llama, Qwen3)."""
    parts = all(
        isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj")
    )
    return parts and type(getattr(module, "act_fn", None)).__name__ in SILU_MODULES


def _swiglu_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP with its SiLU and product as one kernel (`kernels.swiglu`), the engine's."""
    from grpoflow.kernels.swiglu import silu_mul

    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


ROTARY_FUNCTION = "apply_rotary_pos_emb"
"""The rotary function transformers' attention forwards look up in their modeling module."""


def _applies_rotary(module: nn.Module) -> bool:
    """An attention module whose forward applies transformers' rotary function (its own copy of
    the forward then sees `kernels.rotary.rotary_pos_emb`)."""
    forward = getattr(type(module), "forward", None)
    return isinstance(forward, types.FunctionType) and ROTARY_FUNCTION in forward.__code__.co_names


@dataclass
class BatchInvariantKernels:
    """The kernels installed on one model; `remove` puts its modules back as they were."""

    model: nn.Module
    attn_implementation: str | None
    patched: list[nn.Module] = field(default_factory=list)

    @classmethod
    def install(cls, model: nn.Module, torch_compile: bool = False) -> BatchInvariantKernels:
        """Put `model`'s linear layers (a LoRA policy's adapters included), RMSNorms, rotary
        embedding, attention and sparse blocks (router and experts) on the kernels. Refuses what the
        native engine's batch-invariant forward cannot reproduce (one line)."""
        from grpoflow.kernels.batch_invariant import matmul_forward
        from grpoflow.kernels.batch_invariant_ops import rotary_tables
        from grpoflow.kernels.rotary import rotary_pos_emb
        from grpoflow.models.batch_invariant import refusal
        from grpoflow.models.moe import is_sparse
        from grpoflow.policy.lora import generation_model

        if torch_compile:
            raise ValueError(
                "batch_invariant needs torch_compile off: compiling fuses the operations between the "
                "kernels and changes their rounding; set torch_compile: false (or batch_invariant: false)"
            )
        model = generation_model(model)  # a PEFT model's transformers model, its LoRA layers in place
        reason = refusal(model)
        if reason is not None:
            raise ValueError(f"batch_invariant cannot run this model: {reason}; set batch_invariant: false")
        register()
        installed = cls(model, getattr(model.config, "_attn_implementation", None))
        rotary = model.model.rotary_emb
        tables = rotary_tables(rotary, next(model.parameters()).device)
        routers = {id(m.gate) for m in model.modules() if is_sparse(m)}
        for module in model.modules():
            if is_sparse(module):
                module.forward = types.MethodType(_sparse_block_forward, module)
            elif id(module) in routers:
                module.forward = types.MethodType(_router_forward, module)
            elif isinstance(module, InputDtypeLinear):
                module.forward = types.MethodType(_input_dtype_linear_forward, module)
            elif isinstance(module, nn.Linear):
                module.forward = types.MethodType(_linear_forward, module)
                module.linear_product = matmul_forward  # the head's product on the fused log-prob path
            elif type(module).__name__.endswith("RMSNorm"):
                module.forward = types.MethodType(_rms_norm_forward, module)
            elif module is rotary:
                module.forward = functools.partial(_rotary_forward, tables)
            elif _is_swiglu_mlp(module):
                module.forward = types.MethodType(_swiglu_mlp_forward, module)
            elif _applies_rotary(module):
                wanted = {ROTARY_FUNCTION: rotary_pos_emb}
                module.forward = types.MethodType(with_globals(type(module).forward, wanted), module)
            else:
                continue
            installed.patched.append(module)
        model.set_attn_implementation(NAME)
        return installed

    def remove(self) -> None:
        """The stock forwards and the attention implementation the model had before."""
        for module in self.patched:
            module.__dict__.pop("forward", None)
            module.__dict__.pop("linear_product", None)
        self.patched = []
        self.model.set_attn_implementation(self.attn_implementation or "sdpa")
