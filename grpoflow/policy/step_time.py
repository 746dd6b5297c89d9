"""A prediction of one training step's seconds, split into rollout, update and weight sync, from
the model's shape, the step's workload and the GPU's memory bandwidth and bf16 peak: pure
arithmetic, before anything is loaded.

- rollout: the prefill's FLOPs at the bf16 peak, plus each decode step at the slower of reading
  the weights and every row's KV cache at the memory bandwidth and its FLOPs at the peak, over
  `ROLLOUT_EFFICIENCY` (what the engine reaches of that roofline: kernel launches, sampling,
  scheduling); a mixture-of-experts step reads its dense weights and the experts its rows are
  routed to (each of E experts is missed by all of R rows choosing k with probability
  (1 - k/E)^R), and its FLOPs count the active parameters;
- update: 6 x active parameters x trained tokens (4 x under LoRA: no gradients of the frozen weights),
  one forward more (2 x) with gradient checkpointing, 2 x per extra forward pass (reference
  log-probs, old-policy log-probs), at the bf16 peak times the model FLOPs utilisation measured
  eager or compiled;
- sync: the weights copied to an engine that keeps its own copy, at the memory bandwidth (none
  for an engine that shares the policy's weights).

The constants come from the measured steps in benchmarks/results/, each named where it is set.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpoflow.options import require
from grpoflow.policy.memory_plan import ModelShape


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """What bounds a step on one GPU."""

    name: str
    bandwidth: float
    """Memory bandwidth in bytes per second, as measured (below the nominal figure)."""
    bf16_flops: float
    """Dense bf16 matrix products in FLOP/s, as measured."""


KNOWN_GPUS: dict[str, GpuSpec] = {
    # Copy bandwidth 3.01 TB/s (2026-11-25-rollout-products-by-shape-*H100*.json,
    # copy_bandwidth_bytes_per_s; nominal 3.35 TB/s); bf16 products 787 TFLOP/s
    # (benchmarks/grpo_step.py MATMUL_TFLOPS; nominal 989 dense).
    "H100": GpuSpec("H100", 3.0e12, 787e12),
    # Nominal 4.8 TB/s at the H100's measured share of nominal (0.9); 790 TFLOP/s measured
    # (benchmarks/grpo_step.py MATMUL_TFLOPS).
    "H200": GpuSpec("H200", 4.3e12, 790e12),
    # Nominal 2.0 TB/s and 312 TFLOP/s at the H100's measured shares of nominal (0.9, 0.8).
    "A100": GpuSpec("A100", 1.8e12, 250e12),
}
"""GPUs by a name their device name contains (an H100 is the SXM part)."""

ROLLOUT_EFFICIENCY = 0.36
"""Share of the roofline the native engine's rollout reaches within a step: the standard workload
(Qwen2-0.5B shape, 64 prompts x 8, prompt 128, 256 new tokens) has a roofline of 0.233 s on an
H100 and rolled out in 0.647 s, the mean rollout_s of the four H100 runs of
2026-11-25-grpo-step-standard-*.json (the engine alone, without the step's wake and sleep,
reached 0.39: 2026-11-25-rollout-products-by-shape-*H100*.json, roofline_fraction)."""
EAGER_MFU = 0.33
"""Model FLOPs utilisation (recomputation counted) of an eager update: the standard workload's
update took 3.004 s with gradient checkpointing, micro-batch 32
(2026-11-25-grpo-step-standard-defaults-vs-trl-*H100*.json, update_s)."""
COMPILED_MFU = 0.545
"""Model FLOPs utilisation of an update with torch_compile: the standard workload's update took
1.36 s without gradient checkpointing, micro-batch 64
(2026-11-25-grpo-step-standard-gc0-mb64-compile-*H100*.json, update_s; 7B LoRA compiled reached
0.57: 2026-11-25-lora-step-*-bf16-adapters-compile.json, update_tflops_hardware / 787)."""


def known_gpu(device_name: str) -> GpuSpec | None:
    """The spec of the GPU whose device name (`NVIDIA H100 80GB HBM3`) names a known one, else None."""
    return next((spec for key, spec in KNOWN_GPUS.items() if key in device_name.upper()), None)


@dataclass(frozen=True, slots=True)
class Workload:
    """What one step generates and trains on one GPU."""

    prompts: int
    """Prompts per step."""
    generations: int
    """Completions per prompt."""
    prompt_length: int
    """Tokens per prompt."""
    completion_length: int
    """New tokens per completion (the decode steps)."""

    def __post_init__(self) -> None:
        for name in ("prompts", "generations", "prompt_length", "completion_length"):
            require(getattr(self, name) >= 1, name, ">= 1", getattr(self, name))

    @property
    def rows(self) -> int:
        return self.prompts * self.generations

    @property
    def trained_tokens(self) -> int:
        return self.rows * (self.prompt_length + self.completion_length)


@dataclass(frozen=True, slots=True)
class UpdatePasses:
    """The update's settings that decide its FLOPs and their speed."""

    gradient_checkpointing: bool = False
    torch_compile: bool = False
    lora: bool = False
    extra_forwards: int = 0
    """Forward passes beside the trained one: reference log-probs (beta != 0), old-policy
    log-probs (num_iterations > 1)."""
    iterations: int = 1
    """Optimizer steps per generation batch (num_iterations)."""
    engine_shares_weights: bool = True
    """The rollout engine reads the policy's own weights (nothing to sync)."""


@dataclass(frozen=True, slots=True)
class StepTime:
    """Predicted seconds of one step, by phase."""

    rollout: float
    update: float
    sync: float

    @property
    def total(self) -> float:
        return self.rollout + self.update + self.sync

    def describe(self) -> str:
        return (
            f"predicted step {self.total:.2f} s: rollout {self.rollout:.2f} s, update "
            f"{self.update:.2f} s, sync {self.sync:.3f} s"
        )


def rollout_seconds(shape: ModelShape, workload: Workload, gpu: GpuSpec) -> float:
    """Prefill at the bf16 peak (each prompt once: a group's samples share its cached prompt),
    then every decode step at its roofline, over ROLLOUT_EFFICIENCY."""
    params = shape.num_active_parameters()
    weight_bytes = decode_weight_bytes(shape, workload.rows)
    kv_per_token = 2 * shape.num_hidden_layers * shape.kv_size * shape.dtype_bytes
    attention_per_context = 4 * shape.num_hidden_layers * shape.num_attention_heads * shape.attention_head_dim
    prefill = 2 * params * workload.prompts * workload.prompt_length / gpu.bf16_flops
    decode = 0.0
    for step in range(1, workload.completion_length + 1):
        context = workload.rows * (workload.prompt_length + step)
        read = (weight_bytes + context * kv_per_token) / gpu.bandwidth
        compute = (2 * params * workload.rows + attention_per_context * context) / gpu.bf16_flops
        decode += max(read, compute)
    return (prefill + decode) / ROLLOUT_EFFICIENCY


def decode_weight_bytes(shape: ModelShape, rows: int) -> float:
    """The weight bytes one decode step of `rows` rows reads: all of a dense model's; of a
    mixture-of-experts model, the experts that some row is expected to be routed to."""
    if not shape.num_experts:
        return shape.num_parameters() * shape.dtype_bytes
    missed = (1 - shape.num_experts_per_tok / shape.num_experts) ** rows
    idle = shape.num_moe_layers * shape.num_experts * missed * shape.expert_parameters()
    return (shape.num_parameters() - idle) * shape.dtype_bytes


def update_seconds(shape: ModelShape, workload: Workload, gpu: GpuSpec, passes: UpdatePasses) -> float:
    """The update's FLOPs (see the module's docstring) at the bf16 peak times the measured MFU."""
    per_token = 4 if passes.lora else 6
    if passes.gradient_checkpointing:
        per_token += 2
    tokens = workload.trained_tokens
    flops = (
        shape.num_active_parameters() * tokens * (per_token * passes.iterations + 2 * passes.extra_forwards)
    )
    return flops / (gpu.bf16_flops * (COMPILED_MFU if passes.torch_compile else EAGER_MFU))


def sync_seconds(shape: ModelShape, gpu: GpuSpec, passes: UpdatePasses) -> float:
    """The weights copied once at the memory bandwidth; nothing when the engine shares them."""
    if passes.engine_shares_weights:
        return 0.0
    return shape.num_parameters() * shape.dtype_bytes / gpu.bandwidth


def predict_step(shape: ModelShape, workload: Workload, gpu: GpuSpec, passes: UpdatePasses) -> StepTime:
    """One step's predicted seconds by phase."""
    return StepTime(
        rollout=rollout_seconds(shape, workload, gpu),
        update=update_seconds(shape, workload, gpu, passes),
        sync=sync_seconds(shape, gpu, passes),
    )
