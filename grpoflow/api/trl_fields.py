"""TRL GRPOConfig fields said in other words in grpoflow, and why the others are refused.

`TRANSLATED` turns a field into the options it sets: the model's loading arguments
(`model_init_kwargs`), gradient checkpointing's (`gradient_checkpointing_kwargs`), TF32, a warmup
given as a ratio, `shuffle_dataset`, and the upload fields (refused when they would upload). `check_generation_batch`
takes TRL's `steps_per_generation` and `generation_batch_size` where they describe grpoflow's
generation batch. `REFUSED` gives each family of fields grpoflow does not take the reason, or what
to set instead, that its refusal says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from grpoflow.distributed import launched_world_size
from grpoflow.options.loader import coerce
from grpoflow.policy.auto_settings import DEFAULT_MICRO_BATCH

logger = logging.getLogger("grpoflow.api")

NO_UPLOAD = (
    "grpoflow does not upload; upload trainer.save_model's directory with huggingface_hub.upload_folder"
)

HUB_DEFAULTS = {
    "hub_model_id": None,
    "hub_token": None,
    "hub_private_repo": None,
    "hub_revision": None,
    "hub_strategy": "every_save",
    "hub_always_push": False,
}
"""The upload fields, each with its value that uploads nothing."""


def push_to_hub(value: Any) -> dict[str, Any]:
    if coerce("push_to_hub", value, bool):
        raise ValueError(f"push_to_hub=True is not supported: {NO_UPLOAD}")
    return {}


def _hub_field(field: str) -> Callable[[Any], dict[str, Any]]:
    def translate(value: Any) -> dict[str, Any]:
        if value != HUB_DEFAULTS[field]:
            raise ValueError(f"{field}={value!r} is not supported: {NO_UPLOAD}")
        return {}

    return translate


MODEL_INIT_KEYS = {
    "torch_dtype": "torch_dtype",
    "dtype": "torch_dtype",
    "attn_implementation": "attn_implementation",
    "trust_remote_code": "trust_remote_code",
}
"""`model_init_kwargs` keys grpoflow takes, each with the option it sets."""


def model_init_kwargs(value: Any) -> dict[str, Any]:
    """`from_pretrained`'s dtype, attn_implementation and trust_remote_code as the model options; a
    torch.dtype (`torch.bfloat16`) is taken by its name."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"model_init_kwargs must be a dict; got {type(value).__name__}")
    options = {}
    for key, item in value.items():
        if key not in MODEL_INIT_KEYS:
            raise ValueError(
                f"model_init_kwargs[{key!r}] is not supported: grpoflow loads and places the model "
                f"itself and takes {', '.join(MODEL_INIT_KEYS)} only"
            )
        if key in ("torch_dtype", "dtype") and not isinstance(item, str):
            item = str(item).removeprefix("torch.")
        options[MODEL_INIT_KEYS[key]] = item
    return options


def gradient_checkpointing_kwargs(value: Any) -> dict[str, Any]:
    """`use_reentrant` only: grpoflow checkpoints every decoder layer with use_reentrant=False."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"gradient_checkpointing_kwargs must be a dict; got {type(value).__name__}")
    for key, item in value.items():
        if key != "use_reentrant":
            raise ValueError(
                f"gradient_checkpointing_kwargs[{key!r}] is not supported: grpoflow checkpoints every "
                "decoder layer (gradient_checkpointing) and takes use_reentrant only"
            )
        if coerce("use_reentrant", item, bool):
            logger.warning(
                "gradient_checkpointing_kwargs use_reentrant=True: grpoflow checkpoints with "
                "use_reentrant=False (the gradients are the same)"
            )
    return {}


def tf32(value: Any) -> dict[str, Any]:
    """TF32 matmuls on Ampere and newer GPUs, set for the process as transformers sets them."""
    if value is not None:
        import torch

        enabled = coerce("tf32", value, bool)
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
    return {}


def warmup_steps(value: Any) -> dict[str, Any]:
    """transformers' warmup_steps: a whole number of optimizer steps, or a fraction of the run's
    below 1 (warmup_ratio)."""
    steps = coerce("warmup_steps", value, float)
    if 0 < steps < 1:
        return {"warmup_ratio": steps}
    if steps != int(steps):
        raise ValueError(f"warmup_steps must be a whole number of steps or a fraction below 1; got {value!r}")
    return {"warmup_steps": int(steps)}


def _none_or_empty(field: str, instead: str) -> Callable[[Any], dict[str, Any]]:
    def translate(value: Any) -> dict[str, Any]:
        if value:
            raise ValueError(f"{field}={value!r} is not supported: {instead}")
        return {}

    return translate


TRANSLATED: dict[str, Callable[[Any], dict[str, Any]]] = {
    "push_to_hub": push_to_hub,
    **{field: _hub_field(field) for field in HUB_DEFAULTS},
    "model_init_kwargs": model_init_kwargs,
    "gradient_checkpointing_kwargs": gradient_checkpointing_kwargs,
    "tf32": tf32,
    "shuffle_dataset": lambda value: {"dataset_shuffle": coerce("shuffle_dataset", value, bool)},
    "warmup_steps": warmup_steps,
    "lr_scheduler_kwargs": _none_or_empty(
        "lr_scheduler_kwargs", "grpoflow's schedules take lr_scheduler_type and warmup only"
    ),
    "optim_args": _none_or_empty(
        "optim_args", "grpoflow's AdamW takes learning_rate, adam_beta1, adam_beta2 and weight_decay"
    ),
}
"""TRL fields said in other words in grpoflow, each to the options it sets."""


def check_generation_batch(
    given: Mapping[str, Any], values: Mapping[str, Any], defaults: Mapping[str, Any]
) -> None:
    """TRL's `steps_per_generation` and `generation_batch_size`, where they describe grpoflow's
    generation batch: one optimizer step's (per_device_train_batch_size x gradient_accumulation_steps
    completions per process), on which each step takes num_iterations optimizer steps."""
    accumulation = values.get("gradient_accumulation_steps", defaults["gradient_accumulation_steps"])
    per_device = values.get("per_device_train_batch_size") or DEFAULT_MICRO_BATCH
    processes = launched_world_size()
    why = (
        "grpoflow generates one optimizer step's batch at a time (per_device_train_batch_size x "
        f"gradient_accumulation_steps = {per_device} x {accumulation} completions per process), "
        "then takes num_iterations optimizer steps on it; set gradient_accumulation_steps instead"
    )
    steps = given.get("steps_per_generation")
    if steps is not None and steps != accumulation:
        raise ValueError(f"steps_per_generation={steps!r} is not supported: {why}")
    batch = given.get("generation_batch_size")
    if batch is not None and batch != per_device * accumulation * processes:
        raise ValueError(
            f"generation_batch_size={batch!r} is not supported over {processes} process(es): {why}"
        )


GENERATION_BATCH_FIELDS = frozenset({"steps_per_generation", "generation_batch_size"})
"""Fields `check_generation_batch` reads once every other field is set."""

REASONS = {
    "grpoflow builds AdamW (optim) from learning_rate, adam_beta1, adam_beta2, weight_decay, "
    "lr_scheduler_type and warmup_ratio/warmup_steps": (
        "adam_epsilon",
        "optim_target_modules",
    ),
    "grpoflow runs data-parallel or FSDP under torchrun itself: set fsdp, fsdp_offload_params, "
    "fsdp_mixed_precision": (
        "deepspeed",
        "fsdp_config",
        "accelerator_config",
        "parallelism_config",
        "ddp_backend",
        "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers",
        "ddp_static_graph",
        "local_rank",
        "average_tokens_across_devices",
        "ds3_gather_for_generation",
        "log_on_each_node",
        "save_on_each_node",
    ),
    "grpoflow's kernels are set by torch_dtype, attn_implementation, torch_compile, use_liger_kernel "
    "(Liger's RMSNorm, MLP and rotary kernels) and padding_free": (
        "torch_compile_backend",
        "torch_compile_mode",
        "liger_kernel_config",
        "use_cache",
        "cast_lm_head_to_fp32",
        "bf16_full_eval",
        "fp16_full_eval",
    ),
    "grpoflow trains the policy's own outputs; the loss is set by loss_type, beta, epsilon": (
        "label_smoothing_factor",
        "neftune_noise_alpha",
        "router_aux_loss_coef",
        "disable_dropout",
        "use_bias_correction_kl",
        "vllm_importance_sampling_cap",
    ),
    "grpoflow's reference model is the initial policy, kept frozen": (
        "sync_ref_model",
        "ref_model_mixup_alpha",
        "ref_model_sync_steps",
    ),
    "grpoflow samples with its engines' options (temperature, top_p, top_k, min_p, "
    "repetition_penalty, rollout_engine, use_vllm, vllm_*)": (
        "generation_kwargs",
        "chat_template_kwargs",
        "cache_implementation",
        "use_transformers_continuous_batching",
        "transformers_continuous_batching_config",
        "use_transformers_paged",
        "vllm_model_impl",
        "vllm_enable_sleep_mode",
        "vllm_structured_outputs_regex",
        "vllm_group_port",
        "vllm_max_model_length",
    ),
    "grpoflow reads the prompts itself, in a fresh order per epoch from seed (dataset_shuffle)": (
        "data_seed",
        "ignore_data_skip",
        "train_sampling_strategy",
        "length_column_name",
        "pad_to_multiple_of",
        "auto_find_batch_size",
        "dataloader_prefetch_factor",
        "dataloader_multiprocessing_context",
        "dataloader_in_order",
        "torch_empty_cache_steps",
        "full_determinism",
    ),
    "grpoflow evaluates by sampling eval_dataset (eval_strategy, eval_steps, num_generations_eval)": (
        "eval_delay",
        "prediction_loss_only",
        "eval_do_concat_batches",
        "eval_use_gather_object",
        "eval_accumulation_steps",
        "include_for_metrics",
        "batch_eval_metrics",
        "do_train",
        "do_eval",
        "do_predict",
    ),
    "grpoflow logs to output_dir/metrics.jsonl, report_to (tensorboard, wandb) and log_completions": (
        "project",
        "trackio_space_id",
        "trackio_bucket_id",
        "trackio_static_space_id",
        "logging_nan_inf_filter",
        "log_multimodal",
        "num_completions_to_print",
        "log_unique_prompts",
        "log_completions_hub_repo",
        "skip_memory_metrics",
        "debug",
    ),
    "grpoflow's checkpoints are set by save_strategy, save_steps and save_total_limit": (
        "save_only_model",
        "enable_jit_checkpoint",
        "restore_callback_states_from_checkpoint",
    ),
}
"""Why each family of TRL fields grpoflow does not implement is refused, or what to set instead."""

REFUSED = {field: reason for reason, fields in REASONS.items() for field in fields}
"""Each refused TRL field with the reason its refusal gives."""
