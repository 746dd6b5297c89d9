"""The speed settings a run leaves unset, chosen for its device from its memory plan
(`grpoflow.policy.auto_settings`), and the step time they predict (`grpoflow.policy.step_time`).

`grpoflow train` chooses before anything loads and trains with the config this returns; on the
CPU nothing is planned and the defaults stand, at no cost. Whether Liger's kernels run
(`use_liger_kernel`) is chosen last, once torch_compile is (`grpoflow.policy.liger.choose`), its
reason recorded. `grpoflow plan` prints the same choice and its predicted step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging

import torch

from grpoflow.policy import liger, varlen_attention
from grpoflow.policy.auto_settings import (
    ChosenSettings,
    DeviceFacts,
    UserSettings,
    choose_settings,
    compile_skipped,
)
from grpoflow.policy.batch_invariant import wanted
from grpoflow.policy.compile_costs import expected_seconds
from grpoflow.policy.compiling import cache_key
from grpoflow.policy.loading import resolve_device
from grpoflow.policy.step_time import GpuSpec, StepTime, UpdatePasses, Workload, known_gpu, predict_step
from grpoflow.run.config import GRPOConfig
from grpoflow.run.plan_check import (
    choose_fsdp_layout,
    choose_sleep_level,
    completions_held,
    fsdp_ranks,
    gpu_capacity,
    kv_cache_blocks,
    model_config,
    model_shape,
    plan_settings,
    with_layout,
)

logger = logging.getLogger("grpoflow")


def device_facts(config: GRPOConfig) -> DeviceFacts:
    """The training device as the choice sees it: a CUDA GPU with the memory to plan for (none
    under memory_check off), or the CPU."""
    if resolve_device(config.policy.device).type != "cuda":
        return DeviceFacts("cpu")
    memory = None if config.plan.memory_check == "off" else gpu_capacity(config)
    return DeviceFacts("cuda", memory, compile_available=inductor_compiles())


def planned_gpu(capacity: int) -> DeviceFacts:
    """A GPU of `capacity` bytes to plan for (`grpoflow plan`): the visible one's compiler, or
    Triton assumed beside a GPU not visible here (CUDA builds of torch bring it)."""
    return DeviceFacts("cuda", capacity, inductor_compiles() if torch.cuda.is_available() else True)


def inductor_compiles() -> bool:
    """torch.compile can generate kernels for the visible GPU: Triton is installed and the GPU
    is one Triton supports (compute capability 7.0 or newer)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.get_device_capability() >= (7, 0)


def user_settings(config: GRPOConfig) -> UserSettings:
    """The settings the choice may set, as `config` gives them."""
    return UserSettings(
        gradient_checkpointing=config.policy.gradient_checkpointing,
        micro_batch_size=config.training.per_device_train_batch_size,
        torch_compile=config.policy.torch_compile,
        batch_invariant=batch_invariant_runs(config),
        use_liger_kernel=None if config.policy.use_liger_kernel == "auto" else config.policy.use_liger_kernel,
        shared_prompts=config.training.shared_prompts,
        max_tokens_per_micro_batch=config.training.max_tokens_per_micro_batch,
        padding_free=config.training.padding_free,
        generation_batch=config.generation_batch_size,
        loss_reads_micro_batches=(
            config.algorithm.loss_type == "bnpo" or config.algorithm.top_entropy_quantile < 1.0
        ),
    )


def batch_invariant_runs(config: GRPOConfig) -> bool:
    """The batch-invariant kernels are to run (given, or auto with on_policy_sampling on CUDA)."""
    generation = config.generation
    return wanted(
        generation.batch_invariant, generation.on_policy_sampling, resolve_device(config.policy.device)
    )


def choose(config: GRPOConfig, device: DeviceFacts) -> ChosenSettings:
    """The settings `config` trains with on `device`: whether prompts are shared first, since
    the memory the others are chosen in depends on it."""
    shared = shared_prompts_choice(config, device)
    chosen = with_liger(config, device, choose_speed(config, device, shared_prompts=shared[0]))
    return with_shared_prompts_reason(chosen, shared[1])


def shared_prompts_refusal(config: GRPOConfig, device: DeviceFacts) -> str | None:
    """Why each group's prompt cannot run through the update once here, naming what to change;
    None when it can."""
    from grpoflow.kernels.varlen import VARLEN_PARAMETERS

    if device.kind != "cuda":
        return "off the GPU (the CPU's per-sequence attention gains nothing)"
    if not VARLEN_PARAMETERS:
        return "this torch has no torch.nn.attention.varlen (torch >= 2.10 has)"
    if config.policy.attn_implementation not in (None, varlen_attention.NAME):
        return (
            f"attn_implementation is {config.policy.attn_implementation!r}: unset it or set grpoflow_varlen"
        )
    if batch_invariant_runs(config):
        return "the batch-invariant kernels run (their forward is laid out as the engine's)"
    if model_shape(config, on_gpu=True).num_experts:
        return "a mixture-of-experts model (its routing replay reads each completion's prompt)"
    return None


def shared_prompts_choice(config: GRPOConfig, device: DeviceFacts) -> tuple[bool, str | None]:
    """Whether each group's prompt runs through the update once, and why when auto (one log
    line); shared_prompts: true where it cannot run is refused, naming the fix."""
    setting = config.training.shared_prompts
    if setting is False:
        return False, None
    refusal = shared_prompts_refusal(config, device)
    if setting is True and refusal is not None:
        raise ValueError(f"shared_prompts: true cannot run: {refusal}; or set shared_prompts: false")
    on = refusal is None
    reason = "each group's prompt through the update once" if on else refusal
    if setting is None:
        logger.info("shared_prompts=%s (auto: %s)", on, reason)
        reason = f"auto: {reason}"
    return on, reason


def with_shared_prompts_reason(chosen: ChosenSettings, reason: str | None) -> ChosenSettings:
    """`chosen` with why prompts are shared or not (`shared_prompts_choice`), where one is given."""
    if reason is None:
        return chosen
    return dataclasses.replace(chosen, reasons={**chosen.reasons, "shared_prompts": reason})


def liger_choice(config: GRPOConfig, device: DeviceFacts, torch_compile: bool) -> tuple[bool, str]:
    """Whether Liger's kernels run beside `torch_compile`, and why (`liger.choose`)."""
    setting = config.policy.use_liger_kernel
    facts = liger.LigerFacts(
        cuda=device.kind == "cuda",
        installed=liger.installed(),
        model_type=None,
        torch_compile=torch_compile,
        batch_invariant=config.generation.batch_invariant,
        batch_invariant_runs=batch_invariant_runs(config),
    )
    if setting is not False and facts.cuda and facts.installed:
        facts = dataclasses.replace(facts, model_type=model_config(config).model_type)
    return liger.choose(setting, facts)


def with_liger(config: GRPOConfig, device: DeviceFacts, chosen: ChosenSettings) -> ChosenSettings:
    """`chosen` with whether Liger's kernels run and why (one log line); use_liger_kernel: true
    where they cannot run is refused, naming the fix."""
    setting = config.policy.use_liger_kernel
    on, reason = liger_choice(config, device, chosen.torch_compile)
    if setting == "auto":
        logger.info("use_liger_kernel=%s (%s)", on, reason)
    reasons = {**chosen.reasons, "use_liger_kernel": reason}
    return dataclasses.replace(chosen, use_liger_kernel=on, reasons=reasons)


def choose_speed(config: GRPOConfig, device: DeviceFacts, shared_prompts: bool = False) -> ChosenSettings:
    """The memory and compile settings `config` trains with on `device`, its updates sharing
    prompts or not."""
    user = user_settings(config)
    if device.kind != "cuda" or device.memory_bytes is None:  # nothing planned: no config is read
        return dataclasses.replace(choose_settings(None, None, device, user), shared_prompts=shared_prompts)
    shape = model_shape(config, on_gpu=True)
    base = plan_settings(config, dtype_bytes=shape.dtype_bytes, shared_prompts=shared_prompts)
    chosen = dataclasses.replace(choose_settings(shape, base, device, user), shared_prompts=shared_prompts)
    gpu, steps = gpu_spec(config), config.training.max_steps
    if chosen.torch_compile and chosen.sources["torch_compile"] == "plan" and gpu and steps > 0:
        liger_eager = liger_choice(config, device, torch_compile=False)[0]
        uncompiled = dataclasses.replace(chosen, torch_compile=False, use_liger_kernel=liger_eager)
        eager = predicted_step(applied(config, uncompiled), gpu)
        compiled = predicted_step(applied(config, chosen), gpu).update
        cost = expected_seconds(compile_shape(config, chosen, gpu.name))
        skipped = compile_skipped(steps, eager.update, compiled, cost=cost)
        if skipped:
            logger.info("%s", skipped)
            return dataclasses.replace(chosen, torch_compile=False)
        if cost is not None:
            reason = f"compiling costs about {cost:.0f} s, as earlier runs of these shapes paid"
            return dataclasses.replace(chosen, reasons={**chosen.reasons, "torch_compile": reason})
    return chosen


def compile_shape(config: GRPOConfig, chosen: ChosenSettings, gpu_name: str) -> str:
    """A key of what the update's compiled graphs depend on (`compile_costs`): grpoflow's code and
    libraries (`compiling.cache_key`), the model's architecture (its config, not where it was
    read from: a copy of the model elsewhere compiles to the same graphs), its dtype and adapters,
    the chosen checkpointing and attention, and the GPU."""
    adapter = config.adapter
    architecture = model_config(config).to_dict()
    architecture.pop("_name_or_path", None)
    parts = {
        "code": cache_key(),
        "model": architecture,
        "dtype": str(config.policy.torch_dtype),
        "adapter": [adapter.train_type, adapter.lora_rank, sorted(adapter.target_modules)]
        if adapter.train_type == "lora"
        else adapter.train_type,
        "gradient_checkpointing": chosen.gradient_checkpointing,
        "shared_prompts": chosen.shared_prompts,
        "gpu": gpu_name,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def applied(config: GRPOConfig, chosen: ChosenSettings) -> GRPOConfig:
    """`config` with the chosen settings in place of unset ones; the generation batch unchanged."""
    batch, size = config.generation_batch_size, chosen.micro_batch_size
    accumulation = batch // size if batch % size == 0 else config.training.gradient_accumulation_steps
    training = dataclasses.replace(
        config.training,
        per_device_train_batch_size=size,
        gradient_accumulation_steps=accumulation,
        max_tokens_per_micro_batch=chosen.max_tokens_per_micro_batch,
        shared_prompts=chosen.shared_prompts,
    )
    attention = config.policy.attn_implementation
    policy = dataclasses.replace(
        config.policy,
        gradient_checkpointing=chosen.gradient_checkpointing,
        torch_compile=chosen.torch_compile,
        compile_fallback=chosen.torch_compile and chosen.sources["torch_compile"] != "user",
        use_liger_kernel=chosen.use_liger_kernel,
        attn_implementation=varlen_attention.NAME if chosen.shared_prompts else attention,
        attn_fallback=chosen.shared_prompts and attention is None,
    )
    return dataclasses.replace(config, training=training, policy=policy)


def choose_for_run(config: GRPOConfig, facts: DeviceFacts | None = None) -> tuple[GRPOConfig, ChosenSettings]:
    """The config a run trains with and its chosen settings: then an FSDP run's layout from the
    room they leave, and whether the engine keeps its cache through the update (`sleep_level`)
    last, as it depends on the others. `facts`: the device to choose for (None: the run's own,
    `device_facts`)."""
    chosen = choose(config, facts or device_facts(config))
    config = applied(config, chosen)
    layout = choose_fsdp_layout(config)
    if layout is not None:
        config = with_layout(config, layout.values)
        chosen = dataclasses.replace(
            chosen,
            fsdp_layout=layout.values,
            sources={**chosen.sources, **dict.fromkeys(layout.values, layout.source)},
            reasons={**chosen.reasons, **dict.fromkeys(layout.values, layout.reason)},
        )
    sleep = choose_sleep_level(config)
    chosen = dataclasses.replace(
        chosen,
        sleep_level=sleep.level,
        sources={**chosen.sources, "sleep_level": sleep.source},
        reasons={**chosen.reasons, "sleep_level": sleep.reason},
    )
    return dataclasses.replace(config, vllm=dataclasses.replace(config.vllm, sleep_level=sleep.level)), chosen


def chosen_record(
    config: GRPOConfig, chosen: ChosenSettings, kv_blocks: int | None
) -> dict[str, dict[str, object]]:
    """Each chosen setting's value and source, with the native engine's KV-cache blocks when the
    plan sized them (what run.json keeps); logs one line on what the plan chose."""
    record = chosen.record()
    if kv_blocks is not None:
        record["num_kv_blocks"] = {"value": kv_blocks, "source": "plan"}
    line = chosen.describe(kv_blocks)
    if line is not None:
        logger.info("%s", line)
    return record


def gpu_spec(config: GRPOConfig) -> GpuSpec | None:
    """The GPU to predict the step time for: gpu_name's or the visible one's figures
    (`step_time.KNOWN_GPUS`), each replaced by a measured one given; None when neither knows it."""
    plan = config.plan
    named = plan.gpu_name or (torch.cuda.get_device_name() if torch.cuda.is_available() else "")
    spec = known_gpu(named) if named else None
    bandwidth, tflops = plan.gpu_memory_bandwidth_tbps, plan.gpu_bf16_tflops
    if spec is None and (bandwidth is None or tflops is None):
        return None
    return GpuSpec(
        named or "given",
        bandwidth * 1e12 if bandwidth is not None else spec.bandwidth,
        tflops * 1e12 if tflops is not None else spec.bf16_flops,
    )


def predicted_step(config: GRPOConfig, gpu: GpuSpec, mean_completion_length: float | None = None) -> StepTime:
    """The step time `config` (its settings chosen) predicts on `gpu`, for completions of
    `mean_completion_length` tokens on average (None: the plan's, else each max_completion_length)."""
    algorithm, generation, training = config.algorithm, config.generation, config.training
    mean = mean_completion_length or config.plan.mean_completion_length
    shape = model_shape(config, on_gpu=True)
    workload = Workload(
        prompts=max(1, config.generation_batch_size // generation.num_generations),
        generations=generation.num_generations,
        prompt_length=config.data.max_prompt_length,
        completion_length=generation.max_completion_length,
        mean_completion_length=None if mean is None else min(mean, generation.max_completion_length),
        max_running=engine_rows(config, shape),
    )
    packed = training.padding_free or training.max_tokens_per_micro_batch is not None
    passes = UpdatePasses(
        gradient_checkpointing=bool(config.policy.gradient_checkpointing),
        torch_compile=bool(config.policy.torch_compile),
        lora=config.adapter.train_type == "lora",
        extra_forwards=int(algorithm.beta != 0) + int(algorithm.num_iterations > 1),
        iterations=algorithm.num_iterations,
        engine_shares_weights=generation.engine_name in ("native", "hf"),
        micro_batch=training.micro_batch_size,
        padded=not (packed or training.shared_prompts or config.groups_by_length()),
        shared_prompts=bool(training.shared_prompts),
        fsdp_world_size=fsdp_ranks(config),
        liger=config.policy.use_liger_kernel is True and not config.policy.torch_compile,
    )
    return predict_step(shape, workload, gpu, passes)


def engine_rows(config: GRPOConfig, shape) -> int | None:
    """Completions the native engine's KV cache holds at once (its num_kv_blocks, or the plan's
    for the GPU planned for); None for another engine or without a GPU to plan for."""
    if config.generation.engine_name != "native":
        return None
    blocks = getattr(config.generation.engine, "num_kv_blocks", None)
    if blocks is None:
        capacity = gpu_capacity(config)
        if capacity is None:
            return None
        blocks = kv_cache_blocks(config, shape, capacity)[0]
    return max(1, completions_held(config, blocks))
