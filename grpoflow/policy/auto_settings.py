"""The speed settings a run leaves unset, chosen from the memory plan and the GPU's memory: pure
arithmetic over `memory_plan`, given the device's facts as numbers.

On a CUDA device with a known memory, starting from gradient checkpointing on and the default
micro-batch: checkpointing goes off when the plan fits without it, then the micro-batch grows
(a larger divisor of the step's generation batch, at most `MAX_MICRO_BATCH_TOKENS` tokens) while
the plan still fits; a fit leaves `MARGIN` of the GPU free (the activations are an estimate and
the allocator fragments). torch_compile is on where Inductor can compile for the GPU, except for a
mixture-of-experts model: with Inductor compiling the eight sparse layers of a Qwen3-30B-A3B shape
a first step had not finished after four minutes, where eager steps take 4.7 s and the update
already runs at 51% of an H200's bf16 peak (grouped expert products), and where the batch-invariant
kernels or Liger's kernels are to run (`use_liger_kernel` given true). Whether Liger's kernels run
is decided from facts this module does not hold (`grpoflow.policy.liger.choose`, after torch_compile
is). Every setting the user gave is kept as given. On the CPU nothing is planned: the defaults stand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from grpoflow.policy.memory_plan import GIB, ModelShape, PlanSettings, plan_memory

DEFAULT_MICRO_BATCH = 8
"""Completions per micro-batch when per_device_train_batch_size is unset and nothing is planned
(TRL's default)."""
MARGIN = 0.2
"""Share of the GPU a chosen setting leaves free beside the plan's peak."""
MAX_MICRO_BATCH_TOKENS = 49152
"""The most tokens a chosen micro-batch holds. On an H200 (one call), the standard 0.5B workload's
update took 1.210 s at 64 x 384 tokens, 1.184 s at 128 x 384 and 1.175 s at 256 x 384, its peak
growing from 30 to 52 and 96 GiB, and the rollout beside the larger update slowed by 0.14 s
(benchmarks/results/2026-11-27-grpo-step-standard-micro-batch-*): past 128 x 384, more memory for
no speed."""

COMPILE_SECONDS = 15.0
"""What compiling the decoder layers costs a run once with Inductor's caches empty, training every
parameter or LoRA adapters alike (the layers' floats traced as constants, `compiling`): the first
compiled step's update took 10.9 and 13.1 s more than the next ones for the 0.5B shape on an H200
(2026-11-28-compile-20-steps-cold{-first,}-*), 14.6 s under LoRA
(2026-11-28-compile-lora-cold-constant-floats-*) and 15.2 s for the 7B shape under LoRA
(2026-11-28-compile-7b-lora-cold-constant-floats-*), where tracing every float as an input first
had cost LoRA 78-91 s. A run of shapes compiled before pays what `compile_costs` measured
instead."""

Source = Literal["user", "plan", "default"]


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """What the choice knows of the training device."""

    kind: Literal["cuda", "cpu"]
    memory_bytes: int | None = None
    """The GPU's memory to plan for (None: nothing is planned)."""
    compile_available: bool = False
    """torch.compile can generate kernels for the device (Inductor with Triton)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class UserSettings:
    """The settings the choice may set, as the user gave them (None: unset), and what bounds them."""

    gradient_checkpointing: bool | None = None
    micro_batch_size: int | None = None
    """per_device_train_batch_size."""
    torch_compile: bool | None = None
    max_tokens_per_micro_batch: int | None = None
    padding_free: bool = False
    generation_batch: int = DEFAULT_MICRO_BATCH
    """Completions per step and rank: the micro-batch divides it."""
    loss_reads_micro_batches: bool = False
    """The loss depends on how the batch is cut (bnpo, top_entropy_quantile < 1): the
    micro-batch keeps its default."""
    batch_invariant: bool = False
    """The forward is to run on the batch-invariant kernels, which compiling would change: the plan
    leaves compile off."""
    use_liger_kernel: bool | None = None
    """use_liger_kernel as given (None: auto); true leaves compile off (Liger's kernels are
    refused beside it)."""
    shared_prompts: bool | None = None
    """shared_prompts as given (None: auto)."""


@dataclass(frozen=True, slots=True)
class ChosenSettings:
    """The settings a run trains with, each with where it came from."""

    gradient_checkpointing: bool
    micro_batch_size: int
    torch_compile: bool
    max_tokens_per_micro_batch: int | None
    sources: dict[str, Source] = field(default_factory=dict)
    """Option name to `user`, `plan` or `default`."""
    peak_bytes: int | None = None
    """The plan's peak under these settings (None: nothing planned)."""
    capacity: int | None = None
    use_liger_kernel: bool = False
    """Liger's kernels run (`grpoflow.policy.liger.choose`; until it has chosen, as given)."""
    reasons: dict[str, str] = field(default_factory=dict)
    """Why a setting has its value, by option name, where one says more than its source."""
    sleep_level: int | None = None
    """Whether the engine releases its cache after each rollout (`run.plan_check.choose_sleep_level`,
    once the other settings are in the config); None: not chosen."""
    shared_prompts: bool = False
    """Each group's prompt runs through the update once (`run.chosen_settings.shared_prompts_choice`;
    until it has chosen, as given)."""
    fsdp_layout: dict[str, bool] = field(default_factory=dict)
    """The FSDP layout options a sharded run left unset, as chosen (`run.plan_check.choose_fsdp_layout`,
    before sleep_level); empty: none chosen."""

    def values(self) -> dict[str, object]:
        """The settings by option name."""
        values = {
            "gradient_checkpointing": self.gradient_checkpointing,
            "per_device_train_batch_size": self.micro_batch_size,
            "torch_compile": self.torch_compile,
            "max_tokens_per_micro_batch": self.max_tokens_per_micro_batch,
            "use_liger_kernel": self.use_liger_kernel,
            "shared_prompts": self.shared_prompts,
            **self.fsdp_layout,
        }
        return values if self.sleep_level is None else {**values, "sleep_level": self.sleep_level}

    def record(self) -> dict[str, dict[str, object]]:
        """Each setting's value and source, and its reason where one is given (what run.json keeps)."""
        record: dict[str, dict[str, object]] = {
            name: {"value": value, "source": self.sources[name]} for name, value in self.values().items()
        }
        for name, reason in self.reasons.items():
            record[name]["reason"] = reason
        return record

    def summary(self) -> str:
        """Every setting with its value and source, on one line."""
        shown = [f"{name}={value} ({self.sources[name]})" for name, value in self.values().items()]
        return "settings: " + ", ".join(shown)

    def describe(self, kv_blocks: int | None = None) -> str | None:
        """One line on what the plan chose and why (with the native engine's KV-cache blocks when
        the plan sized them); None when it chose nothing."""
        chosen = [name for name, source in self.sources.items() if source == "plan"]
        if not chosen or self.peak_bytes is None or self.capacity is None:
            return None
        shown = ", ".join(f"{name}={self.values()[name]}" for name in chosen)
        shown += f", KV cache {kv_blocks} blocks" if kv_blocks is not None else ""
        return (
            f"settings chosen from the plan: {shown} (peak {self.peak_bytes / GIB:.1f} of "
            f"{self.capacity / GIB:.1f} GiB; set any of them to override)"
        )


def micro_batch_candidates(user: UserSettings, sequence_length: int) -> list[int]:
    """Micro-batches the plan may choose, smallest first: multiples of the default that divide
    the generation batch and hold at most MAX_MICRO_BATCH_TOKENS tokens (the default always)."""
    batch = user.generation_batch
    sizes = [
        size
        for size in range(DEFAULT_MICRO_BATCH, batch + 1, DEFAULT_MICRO_BATCH)
        if batch % size == 0 and size * sequence_length <= MAX_MICRO_BATCH_TOKENS
    ]
    return sizes or [DEFAULT_MICRO_BATCH]


def choose_settings(
    shape: ModelShape | None, base: PlanSettings | None, device: DeviceFacts, user: UserSettings
) -> ChosenSettings:
    """The settings to train with (see the module's docstring); `base` holds the run's other
    options that decide memory (its checkpointing and micro-batch are replaced here). Without a
    GPU's memory to plan for, `shape` and `base` may be None: the defaults stand."""
    if device.kind != "cuda" or device.memory_bytes is None or shape is None or base is None:
        return _kept(user, "default")
    budget = (1 - MARGIN) * device.memory_bytes

    def peak(checkpointing: bool, micro_batch: int) -> int:
        settings = dataclasses.replace(
            base, gradient_checkpointing=checkpointing, micro_batch_size=micro_batch, kv_cache_bytes=0
        )
        return plan_memory(shape, settings, device.memory_bytes).peak

    checkpointing = user.gradient_checkpointing
    micro_batch = user.micro_batch_size or DEFAULT_MICRO_BATCH
    if checkpointing is None:
        checkpointing = peak(False, micro_batch) > budget
    if user.micro_batch_size is None and not user.loss_reads_micro_batches:
        for size in micro_batch_candidates(user, base.sequence_length):
            if size > micro_batch and peak(checkpointing, size) <= budget:
                micro_batch = size
    compile_ = device.compile_available and not shape.num_experts and not user.batch_invariant
    compile_ = compile_ and user.use_liger_kernel is not True
    compile_ = compile_ if user.torch_compile is None else user.torch_compile
    tokens = user.max_tokens_per_micro_batch
    if tokens is None and user.padding_free and user.micro_batch_size is None:
        tokens = micro_batch * base.sequence_length
    sources = _sources(user, "plan")
    if tokens is None:
        sources["max_tokens_per_micro_batch"] = "default"
    return ChosenSettings(
        gradient_checkpointing=checkpointing,
        micro_batch_size=micro_batch,
        torch_compile=compile_,
        max_tokens_per_micro_batch=tokens,
        use_liger_kernel=bool(user.use_liger_kernel),
        shared_prompts=bool(user.shared_prompts),
        sources=sources,
        peak_bytes=peak(checkpointing, micro_batch),
        capacity=device.memory_bytes,
    )


def _kept(user: UserSettings, source: Source) -> ChosenSettings:
    """The user's settings, the defaults where unset."""
    return ChosenSettings(
        gradient_checkpointing=bool(user.gradient_checkpointing),
        micro_batch_size=user.micro_batch_size or DEFAULT_MICRO_BATCH,
        torch_compile=bool(user.torch_compile),
        max_tokens_per_micro_batch=user.max_tokens_per_micro_batch,
        use_liger_kernel=bool(user.use_liger_kernel),
        shared_prompts=bool(user.shared_prompts),
        sources=_sources(user, source),
    )


def _sources(user: UserSettings, unset: Source) -> dict[str, Source]:
    """`user` for each setting given, `unset` for the others."""
    given = {
        "gradient_checkpointing": user.gradient_checkpointing is not None,
        "per_device_train_batch_size": user.micro_batch_size is not None,
        "torch_compile": user.torch_compile is not None,
        "max_tokens_per_micro_batch": user.max_tokens_per_micro_batch is not None,
    }
    sources: dict[str, Source] = {name: "user" if was_given else unset for name, was_given in given.items()}
    sources["use_liger_kernel"] = "default" if user.use_liger_kernel is None else "user"  # auto, not the plan
    sources["shared_prompts"] = "default" if user.shared_prompts is None else "user"
    return sources


def compile_skipped(
    steps: int, eager_update_s: float, compiled_update_s: float, cost: float | None = None
) -> str | None:
    """Why a run of `steps` steps should not compile when the plan would (what it saves is less
    than compiling costs: `cost` where an earlier run of the same shapes measured it
    (`compile_costs.expected_seconds`), else COMPILE_SECONDS), as a log line; None when compiling
    pays."""
    paid = "as earlier runs of these shapes paid" if cost is not None else "with Inductor's caches empty"
    if cost is None:
        cost = COMPILE_SECONDS
    saved = steps * (eager_update_s - compiled_update_s)
    if saved > cost:
        return None
    return (
        f"torch_compile left off: {steps} steps would save about {max(saved, 0):.0f} s of update, less "
        f"than compiling costs (about {cost:.0f} s, {paid}); set torch_compile: true to compile anyway"
    )
