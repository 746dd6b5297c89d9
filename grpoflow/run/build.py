"""Assemble a run from its config: model, prompts, engine, rewards, optimizer, trainer; and export
a checkpoint as a standalone model."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from grpoflow.data.prompts import build_prompt_items, load_rows, read_system_prompt
from grpoflow.engines import ENGINES, EngineOptions, build_engine
from grpoflow.engines.colocate import ColocateLayout
from grpoflow.policy import lora, placement
from grpoflow.policy.loading import (
    load_model,
    load_tokenizer,
    reference_model,
    resolve_device,
    resolve_dtype,
)
from grpoflow.policy.offload import OptimizerOffload
from grpoflow.rewards import RewardModel, RewardRunner, load_plugins, resolve_reward, reward_name
from grpoflow.run import checkpoint
from grpoflow.run.config import GRPOConfig, PolicyConfig
from grpoflow.run.distributed import init_distributed, run_steps
from grpoflow.run.infer_workers import RolloutServers, worker_gpus
from grpoflow.run.metrics import MetricsLogger
from grpoflow.run.trainer import GRPOTrainer

logger = logging.getLogger("grpoflow")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_rewards(config: GRPOConfig, device: torch.device) -> RewardRunner:
    selection, params = config.rewards, config.reward_params
    load_plugins(selection.external_plugins)
    funcs = [(reward_name(spec), resolve_reward(spec, params)) for spec in selection.reward_funcs]
    if selection.reward_model:
        funcs.append(("reward_model", RewardModel(selection.reward_model, device=device)))
    return RewardRunner(
        funcs,
        selection.reward_weights,
        timeout=params.reward_timeout,
        num_workers=params.reward_num_workers,
    )


def choose_engine(config: GRPOConfig) -> str:
    name = config.generation.rollout_engine
    if config.vllm.num_infer_workers:
        return "vllm_server"
    if config.vllm.use_vllm:
        if name != "auto":
            logger.warning("use_vllm=true: rollout_engine=%s is ignored", name)
        return "vllm" if config.vllm.vllm_mode == "colocate" else "vllm_server"
    if name != "auto":
        return name
    return "native" if "native" in ENGINES else "hf"


def build_trainer(config: GRPOConfig) -> GRPOTrainer:
    """Everything a run needs, checked before any training work starts."""
    training, policy = config.training, config.policy
    seed_everything(training.seed)
    resume = (
        checkpoint.resolve_checkpoint(training.resume_from_checkpoint, training.output_dir)
        if training.resume_from_checkpoint
        else None
    )
    distributed, device = init_distributed(resolve_device(policy.device))
    engine_name = choose_engine(config)
    _check_async(config, engine_name, distributed.world_size)
    if engine_name == "vllm":  # a layout that does not fit the world is refused before any work
        ColocateLayout(
            rank=distributed.rank,
            world_size=distributed.world_size,
            tensor_parallel_size=config.vllm.vllm_tensor_parallel_size,
        )
    if device.type == "cuda":
        # cuDNN's SDPA spends ~1 ms of CPU per call planning (measured on an H100 with torch
        # 2.11), which makes training CPU-bound; flash and memory-efficient attention do not.
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = resolve_dtype(policy.torch_dtype, device)
    tokenizer = load_tokenizer(policy.model, trust_remote_code=policy.trust_remote_code)
    rewards = build_rewards(config, device)
    items = _prompt_items(config, tokenizer)
    model = load_model(
        policy.model, policy, vocab_size=len(tokenizer), seed=training.seed, device=device, dtype=dtype
    )
    if config.adapter.train_type == "lora":
        model = lora.add_lora(model, config.adapter)
    ref_model = reference_model(model) if config.algorithm.beta != 0 else None
    if resume is not None:
        _load_weights(model, resume)
    distributed.broadcast_parameters(model)
    max_model_len = config.data.max_prompt_length + config.generation.max_completion_length
    workers = _start_workers(config, distributed, dtype, max_model_len)
    options = EngineOptions(
        max_model_len=max_model_len,
        gpu_memory_utilization=config.generation.gpu_memory_utilization,
        logprob_chunk_size=config.algorithm.logprob_chunk_size,
        vllm=_server_settings(config, workers),
        exclusive_servers=workers is not None,
        seed=training.seed,
        rank=distributed.rank,
        world_size=distributed.world_size,
    )
    try:
        engine = build_engine(engine_name, lora.generation_model(model), tokenizer, options)
    except Exception:
        if workers:
            workers.check_alive()  # a server that died says why
            workers.close()
        raise
    layout = {
        field.name: getattr(training, field.name) for field in dataclasses.fields(placement.PlacementConfig)
    }
    policy_placement, ref_placement = placement.place_models(
        model,
        ref_model,
        placement.PlacementConfig(**layout),
        device,
        world_size=distributed.world_size,
        engine_shares_weights=engine.shares_policy_weights,
    )
    optimizer, scheduler = build_optimizer(model, config, len(items), distributed.world_size)
    if policy_placement.is_sharded:
        placement.full_optimizer_state(optimizer)
    if training.offload_optimizer:
        OptimizerOffload(optimizer, gc_collect=training.gc_collect_after_offload)
    trainer = GRPOTrainer(
        config,
        model=model,
        tokenizer=tokenizer,
        engine=engine,
        rewards=rewards,
        items=items,
        optimizer=optimizer,
        scheduler=scheduler,
        placement=policy_placement,
        ref_model=ref_model,
        ref_placement=ref_placement,
        distributed=distributed,
        per_prompt_seeds=engine_name == "native",
    )
    if workers:
        trainer.add_cleanup(workers.close)
        if resume is None:  # the servers start from the model's files; the policy may differ
            engine.update_weights(policy_placement.rollout_weights(engine), 0)
    if resume is not None:
        trainer.load_state_dict(checkpoint.load_trainer_state(resume))
        logger.info("resumed from %s at step %d", resume, trainer.step_count)
    return trainer


def _server_settings(config: GRPOConfig, workers: RolloutServers | None):
    """The vLLM section the engine gets: the run's, or one that points at the run's servers."""
    if workers is None:
        return config.vllm
    return dataclasses.replace(config.vllm, vllm_server_base_url=",".join(workers.urls), num_infer_workers=0)


def _start_workers(
    config: GRPOConfig, distributed, dtype: torch.dtype, max_model_len: int
) -> RolloutServers | None:
    """The run's `num_infer_workers` rollout servers for this training process, or None."""
    count = config.vllm.num_infer_workers
    if not count:
        return None
    policy = config.policy
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    on_gpu = distributed.device.type == "cuda" or resolve_device(policy.device).type == "cuda"
    gpus = worker_gpus(
        count, distributed.local_rank, local_world_size, torch.cuda.device_count() if on_gpu else None
    )
    flags = ["--model", policy.model, "--dtype", str(dtype).removeprefix("torch."), "--seed"]
    flags += [str(config.training.seed), "--max-model-len", str(max_model_len)]
    flags += ["--max-num-seqs", str(max(config.vllm.vllm_max_num_seqs, config.generation_batch_size))]
    flags += ["--trust-remote-code"] if policy.trust_remote_code else []
    return RolloutServers(flags, gpus, Path(config.training.output_dir) / "infer_workers")


def _check_async(config: GRPOConfig, engine_name: str, world_size: int) -> None:
    if not config.off_policy.async_generate:
        return
    if engine_name != "vllm_server":
        raise ValueError(
            f"async_generate needs a rollout server to generate while the policy trains: set "
            f"use_vllm: true and vllm_mode: server (e.g. against `grpoflow serve`); the {engine_name} "
            f"engine runs in the training process"
        )
    if config.algorithm.dynamic_sample and world_size > 1:
        raise ValueError(
            "async_generate with dynamic_sample needs one process: its resampling rounds agree across "
            "ranks through collectives, which cannot run beside the update's; turn one of them off"
        )


def _prompt_items(config: GRPOConfig, tokenizer):
    data = config.data
    rows = [
        row for spec in data.dataset for row in load_rows(spec, data.dataset_split, seed=config.training.seed)
    ]
    return build_prompt_items(
        rows,
        tokenizer,
        system=read_system_prompt(data.system),
        max_prompt_length=data.max_prompt_length,
        truncation_strategy=data.truncation_strategy,
    )


def _load_weights(model: torch.nn.Module, directory: Path) -> None:
    from safetensors.torch import load_file

    is_lora = lora.is_peft_model(model)
    if is_lora != lora.is_adapter_checkpoint(directory):
        held, other = ("a full model", "full") if is_lora else ("a LoRA adapter", "lora")
        raise ValueError(
            f"checkpoint {directory} holds {held} but this run has train_type="
            f"{'lora' if is_lora else 'full'}: resume with train_type={other} and the run's other settings"
        )
    if is_lora:
        lora.load_adapter_weights(model, directory)
        return
    state = {}
    for path in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(path), device=str(next(model.parameters()).device)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied - {"lm_head.weight"}:
        raise ValueError(
            f"checkpoint {directory} does not match the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}): resume with the model the run started from"
        )
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def export_checkpoint(checkpoint_dir: str | Path, output_dir: str | Path, *, base: str | None = None) -> Path:
    """Write a checkpoint as a standalone model (`save_pretrained`, with the tokenizer) into
    `output_dir`, loadable by `AutoModelForCausalLM.from_pretrained`.

    An adapter checkpoint is merged into its base model: `base`, or the model of the run that
    wrote it (from its saved config; `tiny` and `random:*` are rebuilt from the run's seed), in
    the run's `torch_dtype` (auto: the base model's own). A full checkpoint is copied as it is.
    """
    directory, output = Path(checkpoint_dir), Path(output_dir)
    if not checkpoint.is_checkpoint(directory):
        raise ValueError(
            f"{directory} is not a complete checkpoint directory (it needs {checkpoint.MARKER} and "
            f"{checkpoint.STATE_FILE}): give a checkpoint-N directory of a run's output_dir"
        )
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"output {output} already exists and is not an empty directory: choose another")
    if not lora.is_adapter_checkpoint(directory):
        if base is not None:
            logger.warning("--base %s is ignored: %s holds a full model, copied as it is", base, directory)
        output.mkdir(parents=True, exist_ok=True)
        for path in directory.iterdir():
            if path.is_file() and path.name not in {checkpoint.MARKER, checkpoint.STATE_FILE}:
                shutil.copy2(path, output / path.name)
        return output
    tokenizer = load_tokenizer(str(directory))
    model = _export_base(directory, base, vocab_size=len(tokenizer))
    lora.merge_adapter_checkpoint(model, directory).save_pretrained(output)
    tokenizer.save_pretrained(output)
    return output


def _export_base(directory: Path, base: str | None, *, vocab_size: int) -> torch.nn.Module:
    """The base model of an adapter checkpoint, on the CPU, as its run loaded it."""
    run_config = checkpoint.load_trainer_state(directory).get("config", {})
    source = base or run_config.get("model")
    if not source:
        raise ValueError(f"{directory} names no base model in its saved config: pass --base MODEL")
    dtype_name = run_config.get("torch_dtype", "auto")
    cpu = torch.device("cpu")
    return load_model(
        source,
        PolicyConfig(model=source, trust_remote_code=run_config.get("trust_remote_code", False)),
        vocab_size=vocab_size,
        seed=run_config.get("seed", 42),
        device=cpu,
        dtype="auto" if dtype_name == "auto" else resolve_dtype(dtype_name, cpu),
    )


def build_optimizer(model: torch.nn.Module, config: GRPOConfig, num_items: int, world_size: int = 1):
    from transformers import get_scheduler

    training = config.training
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=training.learning_rate,
        betas=(training.adam_beta1, training.adam_beta2),
        weight_decay=training.weight_decay,
    )
    optimizer_steps = run_steps(config, num_items, world_size) * config.algorithm.num_iterations
    scheduler = get_scheduler(
        training.lr_scheduler_type,
        optimizer,
        num_warmup_steps=math.ceil(training.warmup_ratio * optimizer_steps),
        num_training_steps=optimizer_steps,
    )
    return optimizer, scheduler


def run(config: GRPOConfig, trainer: GRPOTrainer | None = None) -> list[dict[str, float]]:
    """Train (building the trainer unless given); the metrics of every step."""
    trainer = trainer or build_trainer(config)
    metrics_logger = None
    if trainer.distributed.is_main:  # rank 0 logs the metrics averaged over ranks
        metrics_logger = MetricsLogger(
            config.training.output_dir,
            report_to=[sink for sink in config.log.report_to if sink != "none"],
            total_steps=trainer.total_steps,
            start_step=trainer.step_count,
            show_progress=not config.log.disable_tqdm,
            run_config=config.to_flat_dict(),
        )
    try:
        return trainer.train(metrics_logger)
    finally:
        if metrics_logger is not None:
            metrics_logger.close()
        trainer.close()
