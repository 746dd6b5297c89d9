"""A prediction of one training step's seconds, split into rollout, update and weight sync, from
the model's shape, the step's workload and the GPU's memory bandwidth and bf16 peak: pure
arithmetic, before anything is loaded.

- lengths: every completion runs to `completion_length`, or, given their mean, lengths are
  geometric with that mean once capped at `completion_length` (a long tail);
- rollout: the prefill's FLOPs at the bf16 peak over `PRODUCT_EFFICIENCY`, then each decode step
  of the rows still running at the slower of the engine's host work (`HOST_STEP_SECONDS`) and its
  GPU work: the products at the slower of reading their weights at the memory bandwidth and their
  FLOPs at the peak, over `PRODUCT_EFFICIENCY` (`MOE_PRODUCT_EFFICIENCY`), plus every running
  row's KV cache read over `ATTENTION_EFFICIENCY`, plus under LoRA the adapters' small products
  (`adapter_seconds`); a mixture-of-experts step reads its dense weights and the experts its
  rows are routed to (each of E experts is missed by all of R rows choosing k with probability
  (1 - k/E)^R), and its FLOPs count the active parameters; where the KV cache holds fewer
  completions than the step generates (`Workload.max_running`), the decode runs in waves of those
  it holds (preemption's recomputed prefills not counted);
- update: 6 x active parameters x trained tokens (4 x under LoRA: no gradients of the frozen
  weights), one forward more (2 x) with gradient checkpointing, 2 x per extra forward pass
  (reference log-probs, old-policy log-probs), at the bf16 peak times the model FLOPs utilisation
  measured eager or compiled at the model's product width (LoRA's own; a mixture-of-experts
  update's lower where a micro-batch sends each expert few tokens); a padded micro-batch runs its
  decoder layers over its longest completion's columns (the output head only over real tokens);
  with shared prompts the decoder runs over each prompt once;
- sync: the weights copied to an engine that keeps its own copy, at the memory bandwidth (none
  for an engine that shares the policy's weights); under FSDP also the rollout's gather of the
  other ranks' shards (`FSDP_GATHER_BYTES_PER_S`).

The constants come from the measured steps in benchmarks/results/, each named where it is set.
"""

from __future__ import annotations

import math
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

PRODUCT_EFFICIENCY = 0.81
"""Share of max(weight bytes / bandwidth, FLOPs / peak) a dense model's decode step's products
reach: the Qwen2.5-7B shape in full, 64 x 8 rows (compute-bound), 3.82 s of rollout on an H200
(2026-11-28-grpo-step-7b-full-defaults-*H200.json)."""
MOE_PRODUCT_EFFICIENCY = 0.6
"""The same for a mixture-of-experts model's grouped experts (bandwidth-bound): the Qwen3-30B-A3B
shape with LoRA, 7.75 s of rollout on an H200, its adapters counted
(2026-11-27-grpo-step-qwen3-30b-a3b-lora-plan-chosen-*H200.json)."""
ADAPTER_KERNEL_SECONDS = 3.5e-6
"""What each small product of the native engine's LoRA adapters costs a decode step beside its
bytes: per layer eleven (q/k/v's fused A and three B products, o's A and B, gate/up's fused A and
two B products, down's A and B; six where the MLP is a mixture of experts, whose experts the
adapters leave). Against a full model's rollout they added 1.0 ms a decode step to the standard
workload on an H100 (0.887 s against 0.625 s: 2026-11-28-grpo-step-standard-lora-eager-*H100*.json)
and 2.2 ms to the 7B shape's on an H200 (4.38 s against 3.82 s)."""
ATTENTION_EFFICIENCY = 0.7
"""Share of the memory bandwidth the decode attention reads the KV cache at (H200, 0.5B shape, 512
rows: 135 ms of kernels against 97 ms at the copy bandwidth,
2026-11-27-profile-step-defaults-syncs-removed-H200.txt)."""
HOST_STEP_SECONDS = 2.3e-3
"""The engine's host work per decode step, which a step with little GPU work waits on: 2.2 ms on
an H200 machine (the long-tailed workload's rollout, 2.29 s over 1,024 decode steps of 180 rows
on average: 2026-11-27-grpo-step-long-tail-sleep0-*H200.json; the 0.5B engine at 512 rows, 2.04 ms
a step: rollout-*H200-2026-11-27.json), 2.6 ms on an H100 machine (the standard workload's
rollout, 0.675 s over 256 steps: 2026-11-25-grpo-step-standard-gc0-mb64-compile-*H100.json)."""
FSDP_GATHER_BYTES_PER_S = 1.07e11
"""What a rank receives per second when FSDP gathers the weights for a rollout: 0.107 s for the
three quarters of the Qwen2.5-7B shape's 15.2 GB the other ranks hold, on 4 x H200 over NVLink
(2026-11-28-scaling-7b-full-4xH200-strong-defaults.json, phases_s.gather; 0.073 s in a later
call). The update's reduce-scatter overlaps its products and is left out, as is its gather (none
where the update starts from the rollout's gathered weights): the 4-GPU update measured 2.74 s
against 2.76 s predicted (...-carried-gather.json)."""
EAGER_MFU = ((2088, 0.33), (8240, 0.752))
"""Model FLOPs utilisation (recomputation counted) of an eager update by the width of its products
(`product_width`), measured: the standard workload (Qwen2-0.5B shape, width 2,088) took 3.004 s
with gradient checkpointing, micro-batch 32, without Liger's kernels
(2026-11-25-grpo-step-standard-defaults-vs-trl-*H100*, update_s); the Qwen2.5-7B shape (width
8,240) trained in full, micro-batch 16, without checkpointing, with Liger's kernels, 14.04 s on an
H200 (2026-11-28-grpo-step-7b-full-eager-kv-0.35-*H200.json). Wider products run nearer the peak,
and the memory-bound work between them weighs less."""
EAGER_LIGER_MFU = ((2088, 0.51), (8240, 0.752))
"""The same with Liger's fused norms, MLPs and rotary (`use_liger_kernel`, on by default where
compile is off). At the 0.5B width, COMPILED_MFU's 0.545 over the 1.07 by which compiling sped the
same update on one H200: the standard workload without gradient checkpointing, micro-batch 128,
each group's prompt once, 1.08 s eager (steps 3-4 of 2026-11-28-compile-full-eager-*H200.json)
against 1.01 s compiled (...-compile-full-{cold,warm}-*). EAGER_MFU's 7B point was measured with
Liger's kernels."""
COMPILED_MFU = ((2088, 0.545), (8240, 0.776))
"""The same with torch_compile: the standard workload took 1.36 s without gradient checkpointing,
micro-batch 64 (2026-11-25-grpo-step-standard-gc0-mb64-compile-*H100.json, update_s; 0.585 on an
H200: 2026-11-27-grpo-step-standard-defaults-*H200.json); the 7B shape in full 13.60 s, against
13.65 s eager in the same call (2026-11-28-grpo-step-7b-full-{compiled,defaults}-*H200.json):
compiling pays at small widths only."""
EAGER_LORA_MFU = ((2088, 0.194), (8240, 0.40))
"""The same for an eager LoRA update (4 x FLOPs, each group's prompt once), measured on an H100 at
the plan's settings with shared prompts: the standard workload 2.008 s, micro-batch 64
(2026-11-28-grpo-step-standard-lora-eager-*H100*.json, update_s); the Qwen2.5-7B shape 13.82 s,
micro-batch 16 (2026-11-28-grpo-step-7b-lora-defaults-*H100*.json). The adapters' small products,
their dropout and casts are memory-bound work a full update does not have."""
COMPILED_LORA_MFU = ((2088, 0.253), (8240, 0.57))
"""The same compiled: the standard workload 1.53 s on an H100
(2026-11-28-grpo-step-standard-lora-compiled-*H100*.json); at the 7B width between 0.68 on an H200
(11.14 s, micro-batch 32, prompts repeated: 2026-11-27-grpo-step-7b-lora-64x8-defaults-*H200.json)
and 0.46 on an H100 (11.99 s, micro-batch 16, shared prompts:
2026-11-28-grpo-step-7b-lora-compiled-*H100*.json)."""
MOE_FULL_TOKENS_PER_EXPERT = 620
"""Tokens a micro-batch sends each expert (on average) from which a mixture-of-experts update
runs at a dense one's MFU; below, its MFU falls in proportion (routing, gathers and scatters
around smaller grouped products). On an H200, eager LoRA on Qwen3-30B-A3B shapes: micro-batch
64 x 384 tokens (1,536 per expert) at a dense update's MFU
(2026-11-27-grpo-step-moe-8l-lora-replay-*H200.json), micro-batch 16 (384 per expert) at 0.62 of
it (2026-11-27-grpo-step-qwen3-30b-a3b-lora-plan-chosen-*H200.json)."""


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
    """Most new tokens per completion (max_completion_length)."""
    mean_completion_length: float | None = None
    """The completions' mean length; None: every one runs to completion_length."""
    max_running: int | None = None
    """Most completions the engine holds at once (its KV cache's bound); None: all of them."""

    def __post_init__(self) -> None:
        for name in ("prompts", "generations", "prompt_length", "completion_length"):
            require(getattr(self, name) >= 1, name, ">= 1", getattr(self, name))
        require(self.max_running is None or self.max_running >= 1, "max_running", ">= 1", self.max_running)
        mean = self.mean_completion_length
        require(mean is None or 1 <= mean <= self.completion_length, "mean_completion_length",
                f"between 1 and completion_length ({self.completion_length})", mean)  # fmt: skip

    @property
    def rows(self) -> int:
        return self.prompts * self.generations

    @property
    def waves(self) -> float:
        """How many times over the engine decodes a batch of the completions it holds at once."""
        return max(1.0, self.rows / self.max_running) if self.max_running else 1.0

    def running(self) -> list[float]:
        """Expected share of the completions still running at each decode step (1, 2, ...)."""
        steps, mean = self.completion_length, self.mean_completion_length
        if mean is None or mean >= steps:
            return [1.0] * steps
        stay = _continue_probability(mean, steps)
        return [stay ** (step - 1) for step in range(1, steps + 1)]

    def padded_length(self, rows: int) -> float:
        """Expected longest completion among `rows` of them (a padded micro-batch's columns)."""
        return sum(1 - (1 - share) ** rows for share in self.running())

    @property
    def real_tokens(self) -> float:
        return self.rows * (self.prompt_length + sum(self.running()))


def _continue_probability(mean: float, cap: int) -> float:
    """The per-token probability of going on whose geometric lengths, capped at `cap`, have
    `mean` (bisection; the capped mean rises with it)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        capped = (1 - middle**cap) / (1 - middle) if middle < 1 else cap
        low, high = (middle, high) if capped < mean else (low, middle)
    return low


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
    micro_batch: int = 8
    """Rows per micro-batch."""
    padded: bool = False
    """The micro-batches are padded to their longest completion in the batch's order (not packed,
    not grouped by length: then their tokens are about the real ones)."""
    shared_prompts: bool = False
    """Each group's prompt runs through the decoder once (`algo.shared_prompts`): its tokens count
    once per prompt, not once per completion."""
    fsdp_world_size: int = 1
    """Ranks the weights are sharded over (1: not sharded)."""
    liger: bool = False
    """Liger's fused kernels run in an eager full update of a dense model (EAGER_LIGER_MFU; they
    leave a mixture-of-experts model's experts, most of its work, as they are). LoRA's and compiled
    updates' utilisation does not depend on it (the LoRA figures were measured with them)."""


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


def rollout_seconds(shape: ModelShape, workload: Workload, gpu: GpuSpec, lora: bool = False) -> float:
    """Prefill at the bf16 peak (each prompt once: a group's samples share its cached prompt),
    then every decode step of the rows still running at the slower of the host's work and the
    GPU's, LoRA's adapters (on every linear layer) added to the latter (see the module's
    docstring)."""
    params = shape.num_active_parameters()
    efficiency = MOE_PRODUCT_EFFICIENCY if shape.num_experts else PRODUCT_EFFICIENCY
    kv_per_token = 2 * shape.num_hidden_layers * shape.kv_size * shape.dtype_bytes
    prefill = 2 * params * workload.prompts * workload.prompt_length / gpu.bf16_flops / efficiency
    decode = 0.0
    held = workload.rows / workload.waves
    for step, share in enumerate(workload.running(), start=1):
        rows = held * share  # each still running holds its prompt and `step` new tokens
        read = decode_weight_bytes(shape, max(1, math.ceil(rows))) / gpu.bandwidth
        products = max(read, 2 * params * rows / gpu.bf16_flops) / efficiency
        context = rows * (workload.prompt_length + step)
        attention = context * kv_per_token / gpu.bandwidth / ATTENTION_EFFICIENCY
        adapters = adapter_seconds(shape, rows, gpu) if lora else 0.0
        decode += max(HOST_STEP_SECONDS, products + attention + adapters)
    return prefill + decode * workload.waves


def adapter_seconds(shape: ModelShape, rows: float, gpu: GpuSpec) -> float:
    """What the native engine's LoRA products add to one decode step of `rows` rows: their
    kernels (`ADAPTER_KERNEL_SECONDS`), and their bytes at the bandwidth: each A product reads its
    input, each B product reads and writes the output slice it adds into (the adapters themselves
    are small)."""
    h, q, kv, i = shape.hidden_size, shape.query_size, shape.kv_size, shape.intermediate_size
    attention_kernels, attention_row = 6, h + q + 2 * (q + 2 * kv) + 2 * h
    mlp_kernels, mlp_row = 5, h + i + 2 * 2 * i + 2 * h
    dense = shape.num_hidden_layers - shape.num_moe_layers
    kernels = shape.num_hidden_layers * attention_kernels + dense * mlp_kernels
    per_row = shape.num_hidden_layers * attention_row + dense * mlp_row
    return kernels * ADAPTER_KERNEL_SECONDS + rows * per_row * shape.dtype_bytes / gpu.bandwidth


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
    head = shape.vocab_size * shape.hidden_size
    real = workload.real_tokens
    decoded = real
    if passes.shared_prompts:
        decoded = workload.prompts * workload.prompt_length + workload.rows * sum(workload.running())
    elif passes.padded:
        decoded = workload.rows * (workload.prompt_length + workload.padded_length(passes.micro_batch))
    parameter_tokens = (shape.num_active_parameters() - head) * decoded + head * real
    flops = parameter_tokens * (per_token * passes.iterations + 2 * passes.extra_forwards)
    # a mixture-of-experts model's adapters leave its experts, most of its FLOPs, unadapted
    adapted = passes.lora and not shape.num_experts
    measured = {
        (False, False): EAGER_LIGER_MFU if passes.liger and not shape.num_experts else EAGER_MFU,
        (True, False): COMPILED_MFU,
        (False, True): EAGER_LORA_MFU,
        (True, True): COMPILED_LORA_MFU,
    }[passes.torch_compile, adapted]
    mfu = interpolated(measured, product_width(shape))
    if shape.num_experts:
        tokens = passes.micro_batch * real / workload.rows
        per_expert = tokens * shape.num_experts_per_tok / shape.num_experts
        mfu *= min(1.0, per_expert / MOE_FULL_TOKENS_PER_EXPERT)
    return flops / (gpu.bf16_flops * mfu)


def product_width(shape: ModelShape) -> float:
    """The geometric mean of a layer's hidden and feed-forward widths (an expert's for a
    mixture-of-experts model): how large its matrix products are."""
    inner = shape.moe_intermediate_size if shape.num_experts else shape.intermediate_size
    return math.sqrt(shape.hidden_size * inner)


def interpolated(points: tuple[tuple[float, float], ...], width: float) -> float:
    """The value at `width` on the line through the measured (width, value) `points` over
    log(width), flat beyond the first and the last."""
    if width <= points[0][0]:
        return points[0][1]
    for (low, below), (high, above) in zip(points, points[1:]):
        if width <= high:
            return below + (above - below) * math.log(width / low) / math.log(high / low)
    return points[-1][1]


def sync_seconds(shape: ModelShape, gpu: GpuSpec, passes: UpdatePasses) -> float:
    """The weights copied once at the memory bandwidth (nothing when the engine shares them), and
    under FSDP the other ranks' shards gathered for the rollout."""
    weights = shape.num_parameters() * shape.dtype_bytes
    ranks = passes.fsdp_world_size
    gather = weights * (ranks - 1) / ranks / FSDP_GATHER_BYTES_PER_S
    return gather + (0.0 if passes.engine_shares_weights else weights / gpu.bandwidth)


def predict_step(shape: ModelShape, workload: Workload, gpu: GpuSpec, passes: UpdatePasses) -> StepTime:
    """One step's predicted seconds by phase."""
    return StepTime(
        rollout=rollout_seconds(shape, workload, gpu, lora=passes.lora),
        update=update_seconds(shape, workload, gpu, passes),
        sync=sync_seconds(shape, gpu, passes),
    )
