"""Typed configuration: one small dataclass per component, grouped under `GRPOConfig`.

Users write flat keys with the names they know from TRL's GRPOConfig and ms-swift's
`swift rlhf --rlhf_type grpo` (`learning_rate`, `num_generations`, `beta`, ...), in YAML or as
`--key value` flags; each key belongs to exactly one section, except `max_completion_length`, which
the generation and reward sections share. Unknown keys and bad values raise `ValueError` naming
the key and what is allowed, before any work starts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from grpoflow.rewards import RewardConfig


def _check_positive(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    """The model being trained."""

    model: str | None = None
    """Hugging Face causal LM: a local directory or a hub id; `tiny` builds a small local model."""
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype; auto is bfloat16 on a GPU that supports it, float32 on the CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train; auto picks CUDA when available."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    torch_compile: bool = False
    """Compile each decoder layer with torch.compile for the update phase (fuses the norms,
    rotary embeddings and activations); generation engines are unaffected."""
    trust_remote_code: bool = False
    """Allow model code from the hub."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where prompts come from and how they become token ids."""

    dataset: list[str] = field(default_factory=list)
    """Datasets: a packaged task (echo, gsm8k), a local jsonl/json/parquet/csv file or a hub
    dataset; `NAME#N` takes N rows."""
    dataset_split: str = "train"
    """Split of hub datasets and packaged tasks."""
    system: str | None = None
    """System prompt: text, or the path of a file holding it."""
    max_prompt_length: int = 512
    """Longest prompt in tokens; longer ones follow truncation_strategy."""
    truncation_strategy: Literal["delete", "left", "raise"] = "delete"
    """Prompts over max_prompt_length: delete (skip, reported), left (keep the end), raise."""
    dataset_shuffle: bool = True
    """Shuffle prompts each epoch."""

    def __post_init__(self) -> None:
        _check_positive(self, "max_prompt_length")


@dataclass(kw_only=True, slots=True)
class GenerationConfig:
    """How completions are sampled."""

    num_generations: int = 8
    """Completions per prompt (G)."""
    max_completion_length: int = 512
    """Most new tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are taken on logits divided by it."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
    min_p: float = 0.0
    """Minimum probability relative to the most likely token."""
    repetition_penalty: float = 1.0
    """Penalty on tokens already present; 1.0 is off."""
    stop: list[str] = field(default_factory=list)
    """Extra strings that end a completion."""
    rollout_engine: Literal["auto", "hf", "native"] = "auto"
    """Generation backend: native (grpoflow's engine), hf (transformers generate), auto (native
    where it supports the model, else hf)."""
    gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory the native engine may use for its KV cache."""

    def __post_init__(self) -> None:
        _check_positive(self, "max_completion_length", "temperature")
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 (group-relative advantages need a group), "
                f"got {self.num_generations}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization}")
        _check_positive(self, "repetition_penalty")


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """The GRPO-family objective."""

    beta: float = 0.0
    """KL coefficient; 0 loads no reference model."""
    epsilon: float = 0.2
    """Lower clip range of the importance ratio."""
    epsilon_high: float | None = None
    """Upper clip range (DAPO clip-higher); defaults to epsilon."""
    delta: float | None = None
    """Upper clamp on the unclipped ratio (two-sided clipping); off when None."""
    num_iterations: int = 1
    """Policy updates per generation batch."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """How per-token losses are reduced."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the std of the group, of the batch, or not at all."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Ratio per token (GRPO) or per sequence (GSPO)."""
    mask_truncated_completions: bool = False
    """Truncated completions carry no loss (DAPO overlong filtering; alias overlong_filter)."""
    dynamic_sample: bool = False
    """Drop groups whose rewards have zero spread and sample more prompts (DAPO)."""
    max_resample_times: int = 3
    """Most extra sampling rounds per step under dynamic_sample."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk when computing log-probs, bounding the fp32 logits in memory."""

    def __post_init__(self) -> None:
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        _check_positive(self, "epsilon", "epsilon_high", "num_iterations", "logprob_chunk_size")
        if self.delta is not None and self.delta <= 1:
            raise ValueError(f"delta must be > 1 (an upper bound on the ratio), got {self.delta}")
        if self.max_resample_times < 0:
            raise ValueError(f"max_resample_times must be >= 0, got {self.max_resample_times}")


@dataclass(kw_only=True, slots=True)
class RewardSelectionConfig:
    """Which rewards score completions (their parameters live in RewardConfig)."""

    reward_funcs: list[str] = field(default_factory=list)
    """Registered names (accuracy, format, cosine, repetition, soft_overlong, ...) or import paths
    (`pkg.module:function`, `file.py:function`)."""
    reward_weights: list[float] | None = None
    """One weight per reward (reward_model last); all 1.0 when unset."""
    reward_model: str | None = None
    """A sequence-classification model scoring prompt + completion."""
    external_plugins: list[str] = field(default_factory=list)
    """Python files to load before rewards are resolved (they register rewards)."""


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """Optimisation, schedule, checkpoints."""

    learning_rate: float = 1e-6
    """Peak learning rate of AdamW."""
    lr_scheduler_type: Literal[
        "linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial"
    ] = "linear"
    """Learning-rate schedule (transformers' names)."""
    warmup_ratio: float = 0.0
    """Fraction of steps spent warming up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm; 0 turns clipping off."""
    per_device_train_batch_size: int = 8
    """Completions per micro-batch."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; a step generates their completions in one batch."""
    num_train_epochs: float = 1.0
    """Passes over the prompts when max_steps is not set."""
    max_steps: int = -1
    """Training steps (each: one generation batch, num_iterations optimizer steps); -1 uses
    num_train_epochs."""
    seed: int = 42
    """Seed of data order, sampling and initialisation."""
    output_dir: str = "outputs/grpoflow"
    """Where checkpoints, metrics and logs go."""
    save_steps: int = 500
    """Save a checkpoint every this many steps (and at the end)."""
    save_total_limit: int | None = None
    """Keep at most this many checkpoints (oldest deleted)."""
    resume_from_checkpoint: str | None = None
    """A checkpoint directory, or `latest` for the newest in output_dir."""
    fsdp: bool = False
    """Over several processes, shard parameters, gradients and optimizer state with PyTorch FSDP2
    (one unit per decoder layer); off, every rank holds a full copy and gradients are summed over
    ranks (as DDP)."""
    fsdp_offload_params: bool = False
    """Under fsdp: keep the sharded parameters, gradients and optimizer state on the CPU (the
    optimizer steps there); each unit comes to the GPU for its forward and backward."""
    fsdp_mixed_precision: Literal["auto", "bf16", "no"] = "auto"
    """Under fsdp: bf16 gathers float32 weights in bfloat16 for forward and backward and reduces
    gradients in float32 (sharded weights and optimizer state keep their dtype); auto is bf16 on
    a GPU, no on the CPU; no computes and reduces in the weights' dtype."""
    offload_model: bool = False
    """Keep the policy's weights on the CPU while an engine with its own copy (vLLM) generates,
    and a reference model copy on the CPU except for its log-prob pass (replicated training)."""
    offload_optimizer: bool = False
    """Keep the optimizer state on the CPU between optimizer steps (replicated training)."""
    gc_collect_after_offload: bool = False
    """Collect garbage and empty the CUDA cache after each offload."""

    def __post_init__(self) -> None:
        _check_positive(
            self,
            "learning_rate",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "num_train_epochs",
            "save_steps",
            "save_total_limit",
        )
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(f"max_steps must be > 0, or -1 to use num_train_epochs; got {self.max_steps}")
        if self.fsdp_offload_params and not self.fsdp:
            raise ValueError("fsdp_offload_params needs fsdp=true (it offloads FSDP's shards)")
        for name in ("offload_model", "offload_optimizer"):
            if self.fsdp and getattr(self, name):
                raise ValueError(
                    f"{name} moves a replicated model's memory and does not apply under fsdp: "
                    "use fsdp_offload_params=true (sharded parameters, gradients and optimizer state "
                    "on the CPU), or fsdp=false"
                )


@dataclass(kw_only=True, slots=True)
class AdapterConfig:
    """Full fine-tuning or LoRA adapters (through PEFT)."""

    train_type: Literal["full", "lora"] = "full"
    """Train every parameter, or LoRA adapters only."""
    lora_rank: int = 8
    """LoRA rank r."""
    lora_alpha: int = 32
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_rank)."""
    lora_dropout: float = 0.05
    """Dropout on the LoRA input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names that get adapters; all-linear targets every linear layer but the output head."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters (e.g. embed_tokens)."""

    def __post_init__(self) -> None:
        _check_positive(self, "lora_rank", "lora_alpha")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not self.target_modules:
            raise ValueError("target_modules must name at least one module (or all-linear)")


@dataclass(kw_only=True, slots=True)
class VLLMConfig:
    """vLLM as the rollout engine: colocated in the training process or as a server."""

    use_vllm: bool = False
    """Generate with vLLM instead of the native/hf engines."""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """colocate: vLLM inside the trainer's process; server: a separate `vllm serve` or
    `grpoflow serve`."""
    vllm_gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory a colocated vLLM may take."""
    vllm_max_model_len: int | None = None
    """vLLM's context length; max_prompt_length + max_completion_length when unset."""
    vllm_max_num_seqs: int = 256
    """Most sequences vLLM decodes at once."""
    vllm_enforce_eager: bool = False
    """Skip CUDA-graph capture in vLLM."""
    vllm_enable_prefix_caching: bool = True
    """Let vLLM share KV cache across requests with a common prefix."""
    vllm_tensor_parallel_size: int = 1
    """GPUs (training ranks) per colocated vLLM engine; must divide the number of processes."""
    move_model_batches: int | None = None
    """Push the weights to a colocated vLLM in this many reloads of whole decoder layers, each
    released before the next (bounds the memory of merged or gathered weights); None: one."""
    sleep_level: Literal[0, 1, 2] = 0
    """Between rollouts: 0 keeps vLLM's memory, 1 frees its KV cache, 2 also its weights."""
    vllm_server_host: str | None = None
    """Host of the rollout server (server mode)."""
    vllm_server_port: int = 8000
    """Port of the rollout server."""
    vllm_server_base_url: str | None = None
    """Full URL of the rollout server; overrides host and port. Several, comma-separated, split
    prompts between them."""
    vllm_server_timeout: float = 240.0
    """Seconds to wait for the server to come up."""
    num_infer_workers: int = 0
    """Rollout GPUs per node beside the NPROC_PER_NODE training ones: the run starts a
    `grpoflow serve` on each and trains against them in server mode (0: none)."""
    vllm_weight_transfer: Literal["auto", "collective", "checkpoint"] = "auto"
    """How weights reach rollout servers: collective (packed broadcasts over an NCCL or gloo group;
    `grpoflow serve` only), checkpoint (a safetensors directory each server reloads), auto
    (collective when every server offers it)."""
    weight_sync_interval: int = 1
    """Send the weights to an engine that keeps its own copy every this many steps (rollouts in
    between use weights up to k-1 steps old)."""
    weight_sync_check: bool = True
    """After each sync to an engine that copies weights, compare its log-probs on a probe prompt
    with the trainer's and stop the run on a mismatch (cost logged as time/sync_check)."""
    weight_sync_check_tolerance: float = 0.5
    """Largest mean log-prob gap (nats per token) the check accepts."""

    def __post_init__(self) -> None:
        _check_positive(
            self,
            "vllm_max_model_len",
            "vllm_max_num_seqs",
            "vllm_tensor_parallel_size",
            "vllm_server_port",
            "vllm_server_timeout",
            "weight_sync_interval",
            "weight_sync_check_tolerance",
        )
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(
                f"vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}"
            )
        if self.move_model_batches is not None and self.move_model_batches < 1:
            raise ValueError(
                f"move_model_batches must be >= 1 (or null for a single push), got {self.move_model_batches}"
            )
        if self.num_infer_workers < 0:
            raise ValueError(f"num_infer_workers must be >= 0, got {self.num_infer_workers}")
        if self.num_infer_workers and (self.use_vllm or self.vllm_server_base_url):
            raise ValueError(
                "num_infer_workers starts grpoflow's own rollout servers: leave use_vllm and "
                "vllm_server_base_url unset (for vLLM servers, start them yourself and set "
                "use_vllm: true, vllm_mode: server, vllm_server_base_url)"
            )


@dataclass(kw_only=True, slots=True)
class OffPolicyConfig:
    """Asynchronous generation, and the importance-sampling correction of rollouts that the
    trainer's policy did not sample itself (TRL's and ms-swift's names)."""

    async_generate: bool = False
    """Generate the next step's batch while training on this one (server mode): the batch is
    sampled by the policy one sync older."""
    max_staleness: int = 1
    """Most policy versions a batch's sampling policy may lag the trainer's at its update."""
    vllm_importance_sampling_correction: bool = True
    """Reweight the loss by pi_trainer / pi_sampler on engines that hold their own weights
    (vllm, vllm_server) and under async_generate."""
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "sequence_mask"
    """Ratio per token or per sequence; truncated into, or zeroed outside, the clip range."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """Upper bound of the importance ratio (None: open)."""
    vllm_importance_sampling_clip_min: float | None = None
    """Lower bound of the importance ratio (None: open)."""

    def __post_init__(self) -> None:
        if self.max_staleness < 1:
            raise ValueError(
                f"max_staleness must be >= 1 (a batch generated during the previous update is one "
                f"version old), got {self.max_staleness}"
            )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"vllm_importance_sampling_clip_min ({low}) must not exceed "
                f"vllm_importance_sampling_clip_max ({high})"
            )


@dataclass(kw_only=True, slots=True)
class LogConfig:
    """What gets logged where."""

    logging_steps: int = 1
    """Log metrics every this many steps."""
    log_completions: bool = False
    """Write every completion with its rewards and advantage to completions.jsonl."""
    report_to: list[Literal["tensorboard", "wandb", "none", "all"]] = field(
        default_factory=lambda: ["tensorboard"]
    )
    """Metric sinks besides metrics.jsonl."""
    disable_tqdm: bool = False
    """Turn off the live progress bar."""

    def __post_init__(self) -> None:
        _check_positive(self, "logging_steps")


@dataclass(kw_only=True)
class GRPOConfig:
    """Everything a run needs, one section per component."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rewards: RewardSelectionConfig = field(default_factory=RewardSelectionConfig)
    reward_params: RewardConfig = field(default_factory=RewardConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    log: LogConfig = field(default_factory=LogConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def generation_batch_size(self) -> int:
        """Completions generated per step."""
        return self.training.per_device_train_batch_size * self.training.gradient_accumulation_steps

    def total_steps(self, num_prompts: int) -> int:
        """Training steps: max_steps, or enough generation batches for num_train_epochs."""
        if self.training.max_steps > 0:
            return self.training.max_steps
        per_step = self.generation_batch_size // self.generation.num_generations
        return max(1, math.ceil(self.training.num_train_epochs * num_prompts / per_step))

    def validate(self) -> None:
        """Checks that span sections."""
        if self.policy.model is None:
            raise ValueError(
                "model is not set: pass --model (a local directory or hub id), or run the embedded "
                "default with `grpoflow train` and no arguments"
            )
        if not self.data.dataset:
            raise ValueError("dataset is not set: pass --dataset (e.g. gsm8k, or a jsonl file)")
        if not self.rewards.reward_funcs and not self.rewards.reward_model:
            raise ValueError("no reward: set reward_funcs (e.g. accuracy format) or reward_model")
        g, batch = self.generation.num_generations, self.generation_batch_size
        if batch % g:
            raise ValueError(
                f"per_device_train_batch_size x gradient_accumulation_steps = {batch} completions "
                f"per step must be divisible by num_generations = {g}"
            )
        interval, staleness = self.vllm.weight_sync_interval, self.off_policy.max_staleness
        if self.off_policy.async_generate and interval > staleness:
            raise ValueError(
                f"async_generate with weight_sync_interval={interval} samples batches up to {interval} "
                f"policy versions old: raise max_staleness (now {staleness}) to at least {interval}"
            )
        num_rewards = len(self.rewards.reward_funcs) + bool(self.rewards.reward_model)
        weights = self.rewards.reward_weights
        if weights is not None and len(weights) != num_rewards:
            raise ValueError(
                f"reward_weights has {len(weights)} values but there are {num_rewards} rewards "
                "(reward_funcs, then reward_model): give one weight each"
            )

    def to_flat_dict(self) -> dict[str, Any]:
        """All keys as one flat mapping (what a YAML recipe holds)."""
        flat: dict[str, Any] = {}
        for section in dataclasses.fields(self):
            flat.update(dataclasses.asdict(getattr(self, section.name)))
        return flat

    @classmethod
    def from_flat_dict(cls, values: dict[str, Any]) -> GRPOConfig:
        """Build from flat keys (or keys nested under section names), checking every value."""
        from grpoflow.options.loader import sections_from_flat

        return cls(**sections_from_flat(values))
