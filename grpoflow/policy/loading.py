"""Loading the policy, its tokenizer and the frozen reference model."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from grpoflow import hub
from grpoflow.kernels.recompute import checkpoint_contexts
from grpoflow.options import NOT_AN_OPTION
from grpoflow.policy import liger, varlen_attention
from grpoflow.policy.adapter_checkpoints import is_adapter_checkpoint, load_adapter_weights
from grpoflow.policy.compiling import compile_layers
from grpoflow.policy.lora import WithoutAdapters, is_peft_model
from grpoflow.policy.routing_replay import is_moe_config


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    """The model being trained."""

    model: str | None = None
    """Hugging Face causal LM: a local directory or a hub id; `tiny` builds a small local model."""
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype; auto is bfloat16 on a GPU that supports it, float32 on the CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train; auto picks CUDA when available."""
    gradient_checkpointing: bool | None = None
    """Recompute activations in the backward pass to save memory; unset: `grpoflow train` on a GPU
    turns it on only when the memory plan does not fit without it (off on the CPU)."""
    torch_compile: bool | None = None
    """Compile each decoder layer with torch.compile for the update phase (fuses the norms,
    rotary embeddings and activations); generation engines are unaffected. Unset: on for a CUDA
    device where torch.compile has Triton (off on the CPU)."""
    use_liger_kernel: bool | Literal["auto"] = "auto"
    """Run the training forward's RMSNorms, SwiGLU/GeGLU MLPs and rotary embeddings on Liger
    Kernel's fused Triton kernels (`pip install grpoflow[liger]`; grpoflow.policy.liger), the
    reference model's too. auto: on where they run and pay (`grpoflow train` on CUDA with
    liger-kernel installed, torch_compile and the batch-invariant kernels off, a model type Liger
    supports), the reason recorded in run.json; other commands load the model without them."""
    trust_remote_code: bool = False
    """Allow model code from the hub."""
    attn_implementation: (
        Literal[
            "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "grpoflow_varlen"
        ]
        | None
    ) = None
    """Attention kernel of the training forward (transformers' name); unset: the model's default
    (sdpa). Rollout engines keep their own. `padding_free` wants one that skips what the packed
    mask hides: grpoflow_varlen (torch's varlen flash attention, no extra package; sdpa for
    anything not packed), flex_attention, flash_attention_2."""
    attn_fallback: bool = field(default=False, metadata=NOT_AN_OPTION)
    """attn_implementation was chosen (shared prompts), not given: a model that cannot take it keeps
    its own, with one log line (its updates then run padded)."""
    compile_fallback: bool = field(default=False, metadata=NOT_AN_OPTION)
    """torch_compile was chosen, not given: a model torch.compile cannot take trains uncompiled,
    with one log line."""
    experts_implementation: Literal["eager", "grouped_mm", "batched_mm", "grpoflow_grouped"] | None = None
    """Mixture-of-experts models: how the training forward runs the experts (transformers'
    names, and ours): grpoflow_grouped runs them as two grouped products with fused kernels
    around them (`grpoflow.kernels.grouped_experts`), grouped_mm as transformers' grouped
    products, batched_mm gathers each token's experts' weights, eager loops over the experts;
    unset: grpoflow_grouped on CUDA for SiLU-gated experts in the plain layout (else
    grouped_mm), eager on the CPU. Rollout engines keep their own."""

    def load_tokenizer(self):
        """The model's tokenizer, with a pad token."""
        return load_tokenizer(self.model, trust_remote_code=self.trust_remote_code)

    def build(self, *, vocab_size: int, seed: int, device: torch.device) -> torch.nn.Module:
        """The model on `device` in `torch_dtype`, its layers compiled and checkpointed as set."""
        dtype = resolve_dtype(self.torch_dtype, device)
        return load_model(self.model, self, vocab_size=vocab_size, seed=seed, device=device, dtype=dtype)


GROUPED_EXPERTS = "grpoflow_grouped"
"""`experts_implementation` of `grpoflow.kernels.grouped_experts` (its name there; imported when
chosen: Triton)."""

logger = logging.getLogger("grpoflow.policy.loading")

TINY = "tiny"
"""Model name that builds a small randomly initialised Qwen2 and a character tokenizer locally."""
RANDOM_PREFIX = "random:"
"""`random:PRESET` builds a randomly initialised model of a preset shape (grpoflow.policy.tiny.PRESETS)."""


def local_preset(source: str) -> str | None:
    """The preset a model name asks to build locally, or None for a real model."""
    if source == TINY:
        return TINY
    return source.removeprefix(RANDOM_PREFIX) if source.startswith(RANDOM_PREFIX) else None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible: use device=cpu or auto")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        gpu_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if gpu_bf16 else torch.float32
    return getattr(torch, name)


def load_tokenizer(source: str, *, trust_remote_code: bool = False):
    """The tokenizer of `source` with a pad token (the EOS token when it has none)."""
    if local_preset(source):
        from grpoflow.policy.tiny import build_char_tokenizer

        return build_char_tokenizer()
    from transformers import AutoTokenizer

    if not Path(source).exists() and hub.unreachable():
        raise ValueError(
            hub.unreachable_message(f"model {source!r}") + "; model=tiny builds a small model locally"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as error:
        raise ValueError(_load_hint(source, error)) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    source: str,
    config: PolicyConfig,
    *,
    vocab_size: int,
    seed: int,
    device: torch.device,
    dtype: torch.dtype | Literal["auto"],
) -> torch.nn.Module:
    """A causal LM from a directory or hub id, or the tiny local model, on `device` in `dtype`
    ("auto": a stored model's own dtype, float32 for a local preset)."""
    preset = local_preset(source)
    if preset:
        from grpoflow.policy.tiny import build_preset_model

        dtype = torch.float32 if dtype == "auto" else dtype
        model = build_preset_model(preset, vocab_size, seed=seed, dtype=dtype, device=device)
    else:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype, trust_remote_code=config.trust_remote_code
            )
        except OSError as error:
            raise ValueError(_load_hint(source, error)) from None
    model.to(device)
    if config.attn_implementation is not None:
        set_attention(model, config)
    set_experts_implementation(model, config.experts_implementation, device)
    if config.use_liger_kernel is True:
        liger.apply(model, moe=is_moe_config(model.config))
    if config.torch_compile:
        compile_layers(model, fallback=config.compile_fallback, beside=True)
    if config.gradient_checkpointing:
        options: dict = {"use_reentrant": False}
        if not is_moe_config(model.config):  # a router's choices must repeat: its layers exactly
            # the recompute marked, so that batch-invariant kernels hand it to torch's fast ops
            options["context_fn"] = checkpoint_contexts
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        model.config.use_cache = False
    return model


def set_experts_implementation(model: torch.nn.Module, requested: str | None, device: torch.device) -> None:
    """Run a MoE model's experts as `requested` (unset: `default_experts_implementation`) and
    log which; a dense model takes no setting."""
    config = getattr(model, "config", None)
    if config is None or not is_moe_config(config) or not hasattr(model, "set_experts_implementation"):
        if requested is not None:
            raise ValueError(
                f"experts_implementation={requested!r} applies to mixture-of-experts models; this one "
                "has no experts: leave it unset"
            )
        return
    if requested == GROUPED_EXPERTS:
        from grpoflow.kernels.grouped_experts import experts_refusal

        refusal = experts_refusal(model)
        if refusal is not None:
            raise ValueError(
                f"experts_implementation={requested!r} cannot run this model's experts: {refusal}; "
                "set experts_implementation: grouped_mm"
            )
    chosen, origin = (requested, "as set") if requested else default_experts_implementation(model, device)
    if chosen == GROUPED_EXPERTS:
        from grpoflow.kernels.grouped_experts import register

        register(GROUPED_EXPERTS)
    try:
        model.set_experts_implementation(chosen)
    except (ImportError, KeyError, RuntimeError, ValueError) as error:
        raise ValueError(
            f"experts_implementation={chosen!r} does not load for this model ({error}); "
            "set experts_implementation: eager"
        ) from None
    logger.info("mixture-of-experts layers run their experts with %s (%s)", chosen, origin)


def default_experts_implementation(model: torch.nn.Module, device: torch.device) -> tuple[str, str]:
    """The experts' implementation for an unset `experts_implementation`, and why: eager on the
    CPU; on CUDA grpoflow_grouped where its kernels take the experts, else grouped_mm."""
    if device.type != "cuda":
        return "eager", f"the default on {device.type}"
    from grpoflow.kernels import grouped_experts

    refusal = grouped_experts.experts_refusal(model)
    if refusal is None:
        return GROUPED_EXPERTS, "the default on cuda"
    return "grouped_mm", f"the default on cuda for {refusal}"


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A reference model: a copy of `model` that never trains."""
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def reference_model(model: torch.nn.Module) -> torch.nn.Module:
    """The frozen reference of a policy: a copy of it, or for a LoRA policy the policy itself with
    its adapters off (the base model, no copy)."""
    return WithoutAdapters(model) if is_peft_model(model) else frozen_copy(model)


def set_attention(model: torch.nn.Module, config: PolicyConfig) -> None:
    """Load `config.attn_implementation` into `model`: refused (ValueError, naming the fix) where
    the model cannot take it, unless it was chosen rather than given (`attn_fallback`): then the
    model keeps its own, with one log line."""
    if config.attn_implementation == varlen_attention.NAME:
        varlen_attention.register()
    try:
        model.set_attn_implementation(config.attn_implementation)
    except (ImportError, ValueError) as error:
        if not config.attn_fallback:
            raise ValueError(
                f"attn_implementation={config.attn_implementation!r} does not load for this model "
                f"({error}); leave it unset for sdpa"
            ) from None
        logger.warning(
            "attn_implementation=%s does not load for this model (%s): it keeps its own, and its "
            "updates run padded",
            config.attn_implementation,
            error,
        )


def _load_hint(source: str, error: Exception) -> str:
    error = " ".join(str(error).split())  # one line, whatever the library's message looks like
    if Path(source).exists():
        return f"model {source!r} could not be loaded: {error}"
    return (
        f"model {source!r} is neither a local directory nor reachable on the hub ({error}); "
        f"give a local path, check the name, or use model={TINY} (or random:qwen2-0.5b) for a local random model"
    )


def load_checkpoint_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load a checkpoint's weights (a full model, or a LoRA adapter) into `model`."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    is_lora = is_peft_model(model)
    if is_lora != is_adapter_checkpoint(directory):
        held, other = ("a full model", "full") if is_lora else ("a LoRA adapter", "lora")
        raise ValueError(
            f"checkpoint {directory} holds {held} but this run has train_type="
            f"{'lora' if is_lora else 'full'}: resume with train_type={other} and the run's other settings"
        )
    if is_lora:
        load_adapter_weights(model, directory)
        return
    files, names = sorted(directory.glob("*.safetensors")), set()
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    if not names <= model.state_dict().keys() and (directory / "config.json").exists():
        state = _converted_weights(model, directory)  # read once, in the model's layout
    else:
        state = {}
        for path in files:
            state.update(load_file(str(path), device=str(next(model.parameters()).device)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied - {"lm_head.weight"}:
        raise ValueError(
            f"checkpoint {directory} does not match the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}): resume with the model the run started from"
        )
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _converted_weights(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights under the model's own names, as transformers' `from_pretrained`
    converts the layout `save_pretrained` writes (a MoE model's experts, one tensor each on disk,
    fused into each layer's `gate_up_proj` and `down_proj`), on the CPU."""
    dtype = next(model.parameters()).dtype
    return type(model).from_pretrained(directory, dtype=dtype).state_dict()
